"""forkrl's TRL plugin under real FSDP2 (accelerate's fully_shard per decoder layer), 2 gloo ranks.

accelerate (1.15, 1.16) keeps an FSDP plugin only on accelerator devices; on the CPU it silently falls
back to DDP. The test (only the test) keeps the plugin on the CPU by setting accelerate's
distributed type back to FSDP after its own setup; the model is then really sharded (every
decoder layer an FSDP2 module with DTensor parameters). The plugin with ``tree_packing=True`` under
FSDP2 on two ranks must train to the same parameters as stock TRL in one process with the same
global batch. Every run has a timeout: a hang fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forkrl.core.testing.ranks import run_in_subprocess, run_on_ranks
from forkrl.core.testing.stock import assert_equals_stock

pytest.importorskip("trl")

from .trl_helpers import initial_params, save_tiny_llama, train  # noqa: E402

pytestmark = pytest.mark.slow  # FSDP2 on two ranks against stock in a fresh process

TOL = 1e-4


def _keep_fsdp_on_cpu() -> None:
    """Test-only shim, in the rank's own process: accelerate drops the FSDP plugin on the CPU
    (MULTI_CPU); keep it, so that the model is really wrapped with FSDP2 (torch's fully_shard runs
    on the CPU with gloo)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def keep_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = keep_fsdp


_FSDP = dict(
    fsdp=True,
    fsdp_config={
        "version": 2,
        "reshard_after_forward": True,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "state_dict_type": "FULL_STATE_DICT",
    },
)


def _fsdp_train(model: str, out: Path, mode: str, per_device: int, cfg: dict) -> dict | None:
    """Two steps of the plugin under FSDP2 (``mode="tree"``) or of stock TRL; the main process
    returns the full parameters (and, for the tree, how many FSDP2 modules and the parameter type)."""
    _keep_fsdp_on_cpu()
    extra = _FSDP if mode == "tree" else {}
    params, tr = train(
        model, out / mode, mode == "tree", per_device_train_batch_size=per_device, max_steps=2, **extra, **cfg
    )
    if mode != "tree":
        return {"params": params}
    from torch.distributed.fsdp import FSDPModule

    wrapped = sum(isinstance(m, FSDPModule) for m in tr.model_wrapped.modules())
    full = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in tr.model.named_parameters()
    }
    if not tr.accelerator.is_main_process:
        return None
    return {
        "params": full,
        "fsdp2_modules": wrapped,
        "param_type": type(next(tr.model.parameters())).__name__,
    }


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-fsdp"))


@pytest.mark.parametrize("cfg", [{}, {"beta": 0.1}], ids=["dapo", "beta-ref"])
def test_fsdp2_two_ranks_equal_stock_one_process(cfg, model_path, tmp_path):
    env = {"TRL_EXPERIMENTAL_SILENCE": "1"}
    tree = run_on_ranks(_fsdp_train, 2, model_path, tmp_path, "tree", 2, cfg, init_group=False, env=env)[0]
    assert tree["param_type"] == "DTensor", tree["param_type"]
    assert tree["fsdp2_modules"] >= 3  # decoder layers and the root
    stock = run_in_subprocess(_fsdp_train, model_path, tmp_path, "stock", 4, cfg, env=env)
    assert_equals_stock(stock["params"], tree["params"], initial_params(model_path), TOL)
