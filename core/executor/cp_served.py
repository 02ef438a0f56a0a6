"""The serial schedule's attention in context-parallel replay: one owner's unit, served by every rank.

A *unit* (a block of the owner's chunk, or a response) runs on its owner; at each layer the owner
broadcasts its folded queries, every rank attends them to the part of its shard before the unit
(:func:`partial_forward`) and the owner gathers the partials and merges them with its own causal part
(:class:`ServedAttention`); the other ranks run :func:`serve`, the same collectives from the serving
side. ``s`` is the pass's session (:class:`~forkrl.core.executor.context_parallel._Session`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..attention.split import _expand, _fold, _reduce, _unfold, merge
from .cp_rounds import kernels as _kernels
from .cp_rounds import served_backward, served_forward

__all__ = ["ServedAttention", "partial_backward", "partial_forward", "serve"]


def partial_forward(s, layer: int, q_fold: torch.Tensor, scale: float) -> torch.Tensor:
    """``[1, kv, m, d + 1]``: this rank's partial ``(out, lse)`` of folded queries over its
    visible shard (zeros and ``-inf`` where nothing is visible)."""
    return served_forward(s.keys[layer], s.values[layer], q_fold, s.visible(), scale, s.pack_dtype)


def partial_backward(s, layer: int, q_fold: torch.Tensor, pack: torch.Tensor, scale: float) -> torch.Tensor:
    """This rank's share of the query gradient ``[1, kv, m, d]``; its shard's key/value gradient
    is added to its gradient shard here (``pack``: folded ``dout``, ``out``, ``lse``)."""
    n = s.visible()
    dq, dk, dv = served_backward(s.keys[layer], s.values[layer], q_fold, pack, n, scale)
    if dk is not None and s.key_grads is not None:
        s.key_grads[layer][:, :, :n] += dk.to(s.key_grads[layer].dtype)
        s.value_grads[layer][:, :, :n] += dv.to(s.value_grads[layer].dtype)
    return dq


def serve(s, scale: float, device: torch.device) -> None:
    """Serve the owner's attention calls (and their backward for a grad unit)."""
    for layer in s.attn_layers:
        q_fold = torch.empty(s.shape(s.head_dim), dtype=s.dtype, device=device)
        dist.broadcast(q_fold, s.owner_global(), group=s.group)
        part = partial_forward(s, layer, q_fold, scale)
        dist.gather(part, None, dst=s.owner_global(), group=s.group)
        if s.unit.grad:
            s.saved_queries[layer] = q_fold
    if not s.unit.grad:
        return
    for layer in reversed(s.attn_layers):
        q_fold = s.saved_queries.pop(layer)
        pack = torch.empty(s.shape(2 * s.head_dim + 1), dtype=s.pack_dtype, device=device)
        dist.broadcast(pack, s.owner_global(), group=s.group)
        dq = partial_backward(s, layer, q_fold, pack, scale).contiguous()
        dist.reduce(dq, s.owner_global(), op=dist.ReduceOp.SUM, group=s.group)


class ServedAttention(torch.autograd.Function):
    """The owner's attention at one layer: its own causal part plus every rank's served partial."""

    @staticmethod
    def forward(ctx, q, k, v, session, layer: int, scale: float):  # noqa: D102
        s = session
        b, h, n, d = q.shape
        kv = k.shape[1]
        rep = h // kv
        q, k, v = (t.to(s.dtype) for t in (q, k, v))
        q = q.contiguous()
        flash = _kernels(q)[0]
        out, lse = flash(q, _expand(k, rep), _expand(v, rep), 0.0, True, scale=scale)
        out, lse = out.to(s.pack_dtype), lse.to(s.pack_dtype)
        q_fold = _fold(q, kv).contiguous()
        dist.broadcast(q_fold, s.owner_global(), group=s.group)
        part = partial_forward(s, layer, q_fold, scale)
        parts = [torch.empty_like(part) for _ in range(s.world)]
        dist.gather(part, parts, dst=s.owner_global(), group=s.group)
        for p in parts:  # rank order on every owner: the same rounding whoever owns the unit
            o_j, l_j = _unfold(p[..., :d], b, h, n), _unfold(p[..., d], b, h, n)
            out, lse = merge(out, lse, o_j, l_j)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, q_fold)
        ctx.session, ctx.layer, ctx.scale = s, layer, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        s = ctx.session
        q, k, v, out, lse, q_fold = ctx.saved_tensors
        b, h, n, d = q.shape
        kv = k.shape[1]
        rep = h // kv
        dout = dout.to(q.dtype).contiguous()
        dq, dk, dv = _kernels(q)[1](
            dout, q, _expand(k, rep), _expand(v, rep), out, lse, 0.0, True, scale=ctx.scale
        )
        pd = s.pack_dtype
        pack = torch.cat(
            [_fold(dout, kv).to(pd), _fold(out, kv).to(pd), _fold(lse, kv).to(pd)[..., None]], -1
        )
        pack = pack.contiguous()
        dist.broadcast(pack, s.owner_global(), group=s.group)
        dq_fold = partial_backward(s, ctx.layer, q_fold, pack, ctx.scale).contiguous()
        dist.reduce(dq_fold, s.owner_global(), op=dist.ReduceOp.SUM, group=s.group)
        dq = dq + _unfold(dq_fold, b, h, n)
        return dq, _reduce(dk, rep), _reduce(dv, rep), None, None, None
