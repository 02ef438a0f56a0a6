"""Counting what a pass asks of the device: ATen ops, host-device synchronisations, copies.

A GPU charges for what a CPU hides: each op is a kernel launch (microseconds of host time), each
read of a device value stalls the host until the device drains, each copy moves bytes. A
:class:`DispatchCounter` counts them on any device by intercepting ATen ops (a
``TorchDispatchMode``), so the budgets of a GPU-shaped pass can be tested on a CPU.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SYNC_OPS", "DispatchCounter"]

#: ATen ops that read a device value on the host (a synchronisation on CUDA): ``.item()``/``int()``,
#: data-dependent output shapes (``nonzero``, boolean masking, ``unique``), ``.tolist()``.
SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::nonzero",
        "aten::nonzero_static",
        "aten::masked_select",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::repeat_interleave",  # without output_size its length is read from the device
        "aten::equal",
        "aten::is_nonzero",
        "aten::allclose",
    }
)


class DispatchCounter(TorchDispatchMode):
    """Counts ATen ops dispatched inside ``with counter:``.

    Attributes:
        ops: per op name (``aten::mm``), how many ran (views included).
        syncs: per op name, those of :data:`SYNC_OPS`.
        copies: ``_to_copy``/``copy_`` calls whose source and destination devices differ, and
            every ``_to_copy`` that changes device (host <-> device traffic).
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        name = f"aten::{func._schema.name.split('::')[-1]}"
        if func._overloadpacket is torch.ops.aten.repeat_interleave and kwargs.get("output_size") is not None:
            pass  # the length is given: no read of the device
        elif name in SYNC_OPS:
            self.syncs[name] += 1
        self.ops[name] += 1
        if func._overloadpacket is torch.ops.aten._to_copy and "device" in kwargs:
            src = args[0].device if isinstance(args[0], torch.Tensor) else None
            if src is not None and torch.device(kwargs["device"]) != src:
                self.copies += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        """Every op counted."""
        return sum(self.ops.values())

    def non_view(self) -> int:
        """Ops that are not views or metadata changes (what launches work on a device)."""
        return sum(n for name, n in self.ops.items() if not _is_view(name))

    @property
    def sync_count(self) -> int:
        return sum(self.syncs.values())


_VIEWS = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::alias", "aten::detach", "aten::t",
    "aten::transpose", "aten::permute", "aten::expand", "aten::slice", "aten::select", "aten::unsqueeze",
    "aten::squeeze", "aten::as_strided", "aten::split", "aten::split_with_sizes", "aten::unbind",
    "aten::narrow", "aten::chunk", "aten::view_as", "aten::lift_fresh", "aten::_reshape_alias",
}  # fmt: skip


def _is_view(name: str) -> bool:
    return name in _VIEWS
