"""Helpers for checking forkrl's exactness claims in true float64."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Float64Mode", "SavedBytes"]


def _promote(x):
    if x is torch.float32:
        return torch.float64
    return x


class Float64Mode(TorchFunctionMode):
    """Map every float32 request to float64 (``.float()``, ``.to(torch.float32)``, ``dtype=float32``).

    transformers casts RMSNorm, eager softmax and RoPE to float32 even in a float64 model, which
    stops cross-path agreement near 1e-7; under this mode a float64 model stays float64 throughout.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            func, args = torch.Tensor.to, (args[0], torch.float64)
        elif func is torch.Tensor.to or func is torch.Tensor.type:
            args = tuple(_promote(a) for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = _promote(kwargs["dtype"])
        return func(*args, **kwargs)


class SavedBytes:
    """Peak bytes autograd holds for backward (saved tensors), measured deterministically.

    Each saved tensor's data is boxed while autograd holds it; a box's collection returns its
    bytes. Storage shared by several saves counts once per save (an upper bound, the same for every
    path it compares). Use as ``with meter.measure(): ...`` then read ``meter.peak``.
    """

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor) -> _Box:
        # The data only: keeping the tensor itself (with its grad_fn) would make a saved output
        # reference its own graph node, a cycle that keeps untraversed graph branches alive.
        box = _Box(t.detach())
        n = t.numel() * t.element_size()
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(box, self._free, n)
        return box

    def _free(self, n: int) -> None:
        self.current -= n

    @contextmanager
    def measure(self) -> Iterator[SavedBytes]:
        """Count saves made inside the block; ``peak`` restarts from zero."""
        self.current = self.peak = 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda box: box.t):
            yield self


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
