"""Data-parallel pieces of a tree step: the gradient average and cross-rank metrics.

The tree runs on the unwrapped module, so a DDP wrapper's gradient hooks never fire; the step
averages gradients itself, once per optimizer step, in flat buckets (as DDP's reducer does).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["all_ok", "all_reduce_gradients", "world_size"]


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
    bucket: list[torch.Tensor] = []
    size = 0
    for p in [*params, None]:
        if p is not None:
            bucket.append(p.grad)
            size += p.grad.numel()
        if bucket and (p is None or size >= bucket_elems):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            flat /= world
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket, size = [], 0


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
