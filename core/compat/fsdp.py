"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the class layout and mixed-precision policy the
tree step reads to build a plain replica, and the DTensor reductions it runs."""

from __future__ import annotations

import torch
from torch import nn

from .registry import CHECKED, Private


def _check_fsdp2() -> None:
    from torch.distributed.fsdp import FSDPModule

    assert hasattr(FSDPModule, "_get_fsdp_state") and hasattr(FSDPModule, "unshard")


def is_fsdp2_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def fsdp2_plain_class(module: nn.Module) -> type | None:
    """The class ``fully_shard`` wrapped (``FSDPLlamaForCausalLM`` -> ``LlamaForCausalLM``), or None."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None
    return next(c for c in type(module).__mro__[1:] if not issubclass(c, FSDPModule) and c is not object)


def fsdp2_param_dtype(module: nn.Module) -> torch.dtype | None:
    """The forward dtype of the root's mixed-precision policy (None: the parameters' own)."""
    state = module._get_fsdp_state()
    policy = getattr(state, "_mp_policy", None)
    return getattr(policy, "param_dtype", None)


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def dtensor_mesh(t: torch.Tensor):
    return t.device_mesh


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly sharded) parameter: an all-gather for a DTensor."""
    return t.full_tensor() if is_dtensor(t) else t


def reduce_scatter_like(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Sum the full ``grad`` of every rank and keep this rank's shard, in ``param``'s placement."""
    if not is_dtensor(param):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(grad)
        return grad
    from torch.distributed.tensor import DTensor, Partial

    mesh = param.device_mesh
    partial = DTensor.from_local(grad, mesh, [Partial()] * mesh.ndim, run_check=False)
    return partial.redistribute(mesh, param.placements)


#: This area's entries (checked by ``tests/core/test_compat.py``).
PRIVATES: tuple[Private, ...] = (
    Private(
        "torch",
        "torch.distributed.fsdp FSDPModule class layout and FSDPState._mp_policy",
        "fully_shard makes FSDP<Cls>(FSDPModule, Cls) classes; the tree step builds a plain Cls replica from the "
        "config and runs it in the param_dtype of the root's mixed-precision policy, as FSDP2's forward does",
        _check_fsdp2,
        CHECKED,
    ),
)
