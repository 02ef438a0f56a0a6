"""forkrl's TRL plugin under real FSDP2 (accelerate's fully_shard per decoder layer), 2 gloo ranks.

accelerate 1.15 keeps an FSDP plugin only on accelerator devices; on the CPU it silently falls
back to DDP. The test (only the test) keeps the plugin on the CPU by setting accelerate's
distributed type back to FSDP after its own setup; the model is then really sharded (every
decoder layer an FSDP2 module with DTensor parameters). The plugin with ``tree_packing=True`` under
FSDP2 on two ranks must train to the same parameters as stock TRL in one process with the same
global batch. Every run has a timeout: a hang fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forkrl.core.testing.ranks import clean_env, torchrun

pytest.importorskip("trl")

from .trl_helpers import initial_params, relative_difference, save_tiny_llama  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4

_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from pathlib import Path
import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

# Test-only shim: accelerate drops the FSDP plugin on the CPU (MULTI_CPU); keep it, so that the
# model is really wrapped with FSDP2 (torch's fully_shard runs on the CPU with gloo).
_init = AcceleratorState.__init__
def _keep_fsdp(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
AcceleratorState.__init__ = _keep_fsdp

from tests.trl.trl_helpers import train
mode, out = sys.argv[1], Path(sys.argv[2])
fsdp = dict(fsdp=True, fsdp_config={{"version": 2, "reshard_after_forward": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": "FULL_STATE_DICT"}})
extra = fsdp if mode == "tree" else {{}}
params, tr = train({model!r}, out / mode, mode == "tree", per_device_train_batch_size=int(sys.argv[3]), max_steps=2,
                   **extra, **{cfg!r})
if mode == "tree":
    from torch.distributed.fsdp import FSDPModule
    wrapped = sum(isinstance(m, FSDPModule) for m in tr.model_wrapped.modules())
    full = {{n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in tr.model.named_parameters()}}
    if tr.accelerator.is_main_process:
        print("FSDP2 MODULES", wrapped, "TYPE", type(next(tr.model.parameters())).__name__)
        torch.save(full, out / "tree.pt")
else:
    torch.save(params, out / "stock.pt")
from forkrl.core.testing.ranks import finish
finish()
"""


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-fsdp"))


@pytest.mark.parametrize("cfg", [{}, {"beta": 0.1}], ids=["dapo", "beta-ref"])
def test_fsdp2_two_ranks_equal_stock_one_process(cfg, model_path, tmp_path):
    script = tmp_path / "fsdp.py"
    script.write_text(_SCRIPT.format(repo=str(REPO), model=model_path, cfg=cfg))
    env = clean_env(OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
    tree = torchrun(script, "tree", tmp_path, 2, cwd=REPO, TRL_EXPERIMENTAL_SILENCE="1")
    assert "FSDP2 MODULES" in tree.stdout and "TYPE DTensor" in tree.stdout, tree.stdout[-2000:]
    assert int(tree.stdout.split("FSDP2 MODULES")[1].split()[0]) >= 3  # decoder layers and the root
    stock = subprocess.run(
        [sys.executable, str(script), "stock", str(tmp_path), "4"],
        capture_output=True, text=True, env=env, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert stock.returncode == 0, stock.stderr[-4000:]
    got, want = torch.load(tmp_path / "tree.pt"), torch.load(tmp_path / "stock.pt")
    assert relative_difference(got, want, initial_params(model_path)) < TOL
