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

from pathlib import Path

import pytest
import torch

from forkrl.core.testing.ranks import run_in_subprocess, run_on_ranks
from forkrl.core.testing.stock import assert_equals_stock

pytest.importorskip("trl")
pytest.importorskip("deepspeed")

from .trl_helpers import initial_params, save_tiny_llama, train  # noqa: E402

pytestmark = pytest.mark.slow  # DeepSpeed on two ranks against stock in a fresh process

TOL = 1e-4
_ENV = {"TRL_EXPERIMENTAL_SILENCE": "1"}


def _gloo_for_deepspeed_on_cpu() -> None:
    """Test-only shim, in the rank's own process: accelerate chooses no backend for DeepSpeed on a
    CPU machine; use gloo."""
    from accelerate.state import PartialState

    prepare = PartialState._prepare_backend

    def gloo(self, cpu=False, sagemaker_dp=False, backend=None):
        name, kind = prepare(self, cpu, sagemaker_dp, backend)
        return ("gloo" if name is None else name), kind

    PartialState._prepare_backend = gloo


def _zero_train(model: str, out: Path, mode: str, per_device: int, cfg: dict, stage: int) -> dict | None:
    """Two steps of the plugin under DeepSpeed ZeRO-``stage`` (``stage=0``: stock TRL without
    DeepSpeed, in one process); the main process returns the full parameters and, under DeepSpeed,
    the engine it ran."""
    if stage:
        _gloo_for_deepspeed_on_cpu()
    ds = {
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }
    extra = dict(deepspeed=ds, use_cpu=False) if stage else {}
    params, tr = train(
        model, out / mode, mode == "tree", per_device_train_batch_size=per_device, max_steps=2, **extra, **cfg
    )
    if not stage:
        return {"params": params}
    from forkrl.core.train import is_zero3
    from forkrl.plugins.deepspeed import gathered

    engine = tr.model_wrapped
    with gathered([p for p in tr.model.parameters() if hasattr(p, "ds_id")]):
        full = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    if stage == 3:
        from forkrl.plugins.deepspeed import check

        check()  # forkrl's DeepSpeed contract, on a real partition in this process group
    if not tr.accelerator.is_main_process:
        return None
    return {
        "params": full,
        "engine": (type(engine).__name__, engine.zero_optimization_stage()),
        "partitioned": is_zero3(tr.model),
    }


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
            result = run_in_subprocess(_zero_train, model_path, out, "stock", 4, cfg, 0, env=_ENV)
            cache[key] = result["params"]
        return cache[key]

    return run


@pytest.mark.parametrize(
    "stage,cfg", [(2, {}), (3, {}), (3, {"beta": 0.1})], ids=["zero2-dapo", "zero3-dapo", "zero3-beta-ref"]
)
def test_deepspeed_two_ranks_equal_stock_one_process(stage, cfg, model_path, stock, tmp_path):
    tree = run_on_ranks(
        _zero_train, 2, model_path, tmp_path, "tree", 2, cfg, stage, init_group=False, env=_ENV
    )[0]
    assert tree["engine"] == ("DeepSpeedEngine", stage) and tree["partitioned"] == (stage == 3), tree[
        "engine"
    ]
    assert_equals_stock(stock(cfg), tree["params"], initial_params(model_path), TOL)
