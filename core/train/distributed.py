"""Data-parallel pieces of a tree step: the gradient average, cross-rank metrics, and how a
sequence-parallel group's ranks share micro-batches.

The tree runs on the unwrapped module, so a DDP wrapper's gradient hooks never fire; the step
averages gradients itself, once per optimizer step, in flat buckets (as DDP's reducer does).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import all_reduce_buckets

__all__ = ["all_ok", "all_reduce_gradients", "gather_shares", "share_micro_batches", "world_size"]


def world_size(group=None) -> int:
    """Ranks in ``group`` (1 without an initialised process group)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_reduce_gradients(
    params: Iterable[torch.nn.Parameter], group=None, bucket_elems: int = 1 << 25
) -> None:
    """Average ``param.grad`` over the ranks of ``group``, as DDP's hooks would have.

    A parameter without a gradient on this rank contributes zeros (DDP's behaviour), so every rank
    issues the same collectives. Nothing happens with one rank.
    """
    world = world_size(group)
    if world == 1:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_buckets([p.grad for p in params], group, bucket_elems, divide=world)


def reduce_stats(
    sums: list[float], maxes: list[float], device: torch.device, group=None
) -> tuple[list[float], list[float]]:
    """Sum ``sums`` and take the max of ``maxes`` over ranks (identity with one rank)."""
    if world_size(group) == 1:
        return sums, maxes
    s = torch.tensor(sums, dtype=torch.float64, device=device)
    m = torch.tensor(maxes, dtype=torch.float64, device=device)
    dist.all_reduce(s, group=group)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return s.tolist(), m.tolist()


def all_ok(ok: bool, device: torch.device, group=None) -> bool:
    """Whether every rank of ``group`` is ``ok`` (so that a rank that failed before a collective
    makes every rank stop there, instead of leaving the others waiting in it)."""
    if world_size(group) == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def share_micro_batches(tokens: Sequence[int], size: int, rank: int) -> list[int] | None:
    """The micro-batches rank ``rank`` of a sequence-parallel group of ``size`` runs, when the group's
    ranks, which all hold the same micro-batches, divide them instead of splitting every sequence
    (veRL's Ulysses groups, OpenRLHF's ring-attention groups): a contiguous run, so that rows that
    share prefixes mostly stay on one rank, cut where the cumulative token count crosses
    ``s / size`` of the total (each rank at least one).

    Args:
        tokens: per micro-batch, its token count (the same on every rank of the group).
        size: the group's rank count.
        rank: this rank's index in the group.

    Returns:
        The indices, or None when there are fewer micro-batches than ranks (every rank runs all).
    """
    count = len(tokens)
    if size <= 1 or count < size:
        return None
    total = max(sum(tokens), 1)
    cumulative, bounds, running = [], [0], 0
    for t in tokens:
        running += t
        cumulative.append(running)
    for s in range(1, size):
        cut = next((i + 1 for i, c in enumerate(cumulative) if c * size >= total * s), count)
        bounds.append(min(max(cut, bounds[-1] + 1), count - (size - s)))
    bounds.append(count)
    return list(range(bounds[rank], bounds[rank + 1]))


def gather_shares(own: Sequence[tuple[int, Any]], count: int, group) -> list:
    """Every index's object on every rank of ``group``, after each rank ran its share
    (:func:`share_micro_batches`): each gives ``(index, object)`` for its indices (picklable,
    host-side values); together they must cover ``0 .. count - 1``.

    Raises:
        RuntimeError: naming the indices no rank gave.
    """
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, list(own), group=group)
    out: list = [None] * count
    for part in parts:
        for i, obj in part:
            out[i] = obj
    missing = [i for i, obj in enumerate(out) if obj is None]
    if missing:
        raise RuntimeError(f"forkrl: no rank of the sequence-parallel group returned micro-batches {missing}")
    return out
