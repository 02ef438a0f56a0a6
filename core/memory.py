"""Deterministic memory meters: autograd's saved-tensor peak and the process's peak resident memory.

A product module, not test support: ``forkrl estimate`` prices each path's held activations with
:class:`SavedBytes` (:mod:`forkrl.core.estimate.pricing`); benchmarks and tests use the same meters
(re-exported by :mod:`forkrl.core.testing`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["SavedBytes", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM). Unlike ``ru_maxrss``, which Linux carries over
    from the parent across fork and exec, it starts afresh in a new program."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


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
