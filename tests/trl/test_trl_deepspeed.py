"""forkrl's TRL plugin under real DeepSpeed ZeRO-2 and ZeRO-3 (accelerate's DeepSpeed integration), 2 gloo ranks.

On a CPU machine accelerate picks no distributed backend for a DeepSpeed launch (its
``_prepare_backend`` knows only accelerator backends there); the test (only the test) answers gloo.
The engine is then DeepSpeed's own, from TRL's ``deepspeed=`` config: ZeRO-3 partitions every
parameter (``stage3_param_persistence_threshold=0``; the reference model too, through TRL's
``prepare_deepspeed``). The plugin with ``tree_packing=True`` on two ranks, whose forests differ,
must train to the same parameters as stock TRL in one process with the same global batch (stock TRL
under the same DeepSpeed configs matches that to 5.8e-7, measured). Every run has a timeout: a hang fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forkrl.core.testing.ranks import clean_env, torchrun

pytest.importorskip("trl")
pytest.importorskip("deepspeed")

from .trl_helpers import initial_params, relative_difference, save_tiny_llama  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4

_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from pathlib import Path
import torch
from accelerate.state import PartialState

stage = {stage}
if stage:
    # Test-only shim: accelerate chooses no backend for DeepSpeed on a CPU machine; use gloo.
    _prepare = PartialState._prepare_backend
    def _gloo(self, cpu=False, sagemaker_dp=False, backend=None):
        name, kind = _prepare(self, cpu, sagemaker_dp, backend)
        return ("gloo" if name is None else name), kind
    PartialState._prepare_backend = _gloo

from tests.trl.trl_helpers import train
mode, out, per_device = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
ds = {{"zero_optimization": {{"stage": stage, "stage3_param_persistence_threshold": 0}},
      "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "bf16": {{"enabled": False}},
      "fp16": {{"enabled": False}}}}
extra = dict(deepspeed=ds, use_cpu=False) if stage else {{}}
params, tr = train({model!r}, out / mode, mode == "tree", per_device_train_batch_size=per_device, max_steps=2,
                   **extra, **{cfg!r})
if not stage:
    torch.save(params, out / "stock.pt")
    sys.exit(0)
from forkrl.core.train import is_zero3
engine = tr.model_wrapped
from forkrl.plugins.deepspeed import gathered
with gathered([p for p in tr.model.parameters() if hasattr(p, "ds_id")]):
    full = {{n: p.detach().clone() for n, p in tr.model.named_parameters()}}
if stage == 3:
    from forkrl.plugins.deepspeed import check
    check()  # forkrl's DeepSpeed contract, on a real partition in this process group
if tr.accelerator.is_main_process:
    print("ENGINE", type(engine).__name__, engine.zero_optimization_stage(), "PARTITIONED", is_zero3(tr.model))
    torch.save(full, out / "tree.pt")
from forkrl.core.testing.ranks import finish
finish()
"""


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-deepspeed"))


@pytest.fixture(scope="module")
def stock(model_path, tmp_path_factory):
    """Stock TRL in one process, 4 rows per device (the two ranks' global batch), per config."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def run(cfg: dict) -> dict[str, torch.Tensor]:
        key = repr(cfg)
        if key not in cache:
            out = tmp_path_factory.mktemp("stock")
            script = out / "stock.py"
            script.write_text(_SCRIPT.format(repo=str(REPO), model=model_path, cfg=cfg, stage=0))
            env = clean_env(OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
            proc = subprocess.run(
                [sys.executable, str(script), "stock", str(out), "4"],
                capture_output=True, text=True, env=env, timeout=600, cwd=REPO,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-4000:]
            cache[key] = torch.load(out / "stock.pt")
        return cache[key]

    return run


@pytest.mark.parametrize(
    "stage,cfg", [(2, {}), (3, {}), (3, {"beta": 0.1})], ids=["zero2-dapo", "zero3-dapo", "zero3-beta-ref"]
)
def test_deepspeed_two_ranks_equal_stock_one_process(stage, cfg, model_path, stock, tmp_path):
    script = tmp_path / "zero.py"
    script.write_text(_SCRIPT.format(repo=str(REPO), model=model_path, cfg=cfg, stage=stage))
    tree = torchrun(script, "tree", tmp_path, 2, cwd=REPO, TRL_EXPERIMENTAL_SILENCE="1")
    assert f"ENGINE DeepSpeedEngine {stage} PARTITIONED {stage == 3}" in tree.stdout, tree.stdout[-2000:]
    got = torch.load(tmp_path / "tree.pt")
    assert relative_difference(got, stock(cfg), initial_params(model_path)) < TOL
