"""Collectives over many tensors at once: the few calls a step makes instead of one per tensor.

A gradient reduction issued per parameter pays one collective's latency per parameter (hundreds on a
real model, each a host-side launch and a rendezvous); here tensors are packed into flat buckets of
one dtype and device, and each bucket is reduced in one call, as DDP's buckets are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_reduce_buckets"]


def all_reduce_buckets(
    tensors: Sequence[torch.Tensor], group=None, bucket_elems: int = 1 << 25, divide: int = 1
) -> None:
    """Sum each tensor over the ranks of ``group`` in place (then divide by ``divide``), in flat
    buckets of at most about ``bucket_elems`` elements, one per dtype and device (each element
    reduced in its own dtype, as a per-tensor ``all_reduce`` would).

    Every rank must pass tensors of the same shapes, dtypes and devices, in the same order.
    """
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for kind in sorted(by_kind, key=str):  # the same order on every rank
        bucket: list[torch.Tensor] = []
        size = 0
        for t in [*by_kind[kind], None]:
            if t is not None:
                bucket.append(t)
                size += t.numel()
            if bucket and (t is None or size >= bucket_elems):
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat, group=group)
                if divide != 1:
                    flat /= divide
                offset = 0
                for b in bucket:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()
                bucket, size = [], 0
