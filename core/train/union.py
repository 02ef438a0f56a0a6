"""A context-parallel group whose ranks hold different rows: the step runs the group's union.

A host whose context-parallel ranks are also data-parallel ranks (TRL: accelerate's processes
grouped by ``long_context_cp_size``, each with its own rollouts) cannot split one rank's prompt over
the others as veRL's and OpenRLHF's sequence-parallel groups do (their ranks hold the same rows).
Here every rank gathers the group's micro-batch layouts (token ids only: the host's tensors stay
where they are), and the step trains and scores one forest of all of them, its prompts split over
the group. Each rank runs its host's loss on its own micro-batches only, so the host's side
effects (metrics, logged losses, once-per-step work) are stock's; the other ranks' micro-batches
contribute a zero loss here and their coefficients come from their owners
(:meth:`~forkrl.core.executor.cp_executor.ContextParallelExecutor.combine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..tree import RowLayout, Window

__all__ = ["GroupRows"]

T = TypeVar("T")


@dataclass(frozen=True)
class GroupRows:
    """This rank's micro-batches inside the union of a group's.

    Attributes:
        window: every rank's micro-batches, rank by rank (the same on every rank).
        first: the index of this rank's first micro-batch in ``window``.
        count: this rank's micro-batches.
        ranks: ranks in the group.
    """

    window: Window
    first: int
    count: int
    ranks: int

    @classmethod
    def gather(cls, layouts: Sequence[RowLayout], group: Any) -> GroupRows:
        """Every rank's ``layouts`` (one collective over ``group``), this rank's place among them."""
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        parts: list[Any] = [None] * ranks
        dist.all_gather_object(parts, list(layouts), group=group)
        first = sum(len(p) for p in parts[:rank])
        return cls(Window([lay for part in parts for lay in part]), first, len(layouts), ranks)

    def own(self, values: Sequence[T]) -> list[T]:
        """This rank's entries of a per-micro-batch list over the union."""
        return list(values[self.first : self.first + self.count])

    def loss(self, fn):
        """``fn`` (the host's ``(i, logprobs, entropies) -> scalar`` over its own micro-batches) over
        the union: another rank's micro-batch is a zero whose gradient is zero."""

        def union_fn(i: int, logprobs: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
            if self.first <= i < self.first + self.count:
                return fn(i - self.first, logprobs, entropies)
            zero = logprobs.sum() * 0.0
            return zero if entropies is None else zero + entropies.sum() * 0.0

        return union_fn
