"""DeepSpeed ZeRO-3 partitions, read by attribute only (core imports no host library): the gather
itself is the plugin's (:mod:`forkrl.plugins.deepspeed`), whose contract test checks these attributes
on real partitions; and setting a module's tensor in place of a gathered one."""

from __future__ import annotations

import torch
from torch import nn


def is_zero3_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DeepSpeed ZeRO-3 partitioned parameter."""
    return hasattr(p, "ds_id")


def whole_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's whole shape (a ZeRO-3 partition's ``ds_shape``, else its own)."""
    shape = getattr(p, "ds_shape", None)
    return p.shape if shape is None else torch.Size(shape)


def engine_hooks_of(module: nn.Module, package: str) -> list[tuple[dict, object]]:
    """The forward/backward hooks on ``module`` and its submodules registered by code of
    ``package`` (e.g. DeepSpeed's ZeRO-3 gather hooks), as ``(hook dict, key)`` pairs."""
    found = []
    for sub in module.modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
            hooks = getattr(sub, attr, None) or {}
            for key, fn in hooks.items():
                owner = getattr(fn, "__module__", None) or ""
                if owner.split(".")[0] == package:
                    found.append((hooks, key))
    return found


def set_tensor(module: nn.Module, name: str, value: torch.Tensor, parameter: bool) -> None:
    """Put ``value`` at dotted ``name`` as a parameter or a buffer (replacing what is there)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if parameter:
        owner._parameters[leaf] = value
    else:
        owner._buffers[leaf] = value
