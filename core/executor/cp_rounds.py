"""The parallel schedule of context-parallel replay: every rank computes its part of the prompt at once.

:class:`~forkrl.core.executor.context_parallel.ContextParallelReplay` with ``schedule="parallel"``
splits the cached prompt into *rounds* of ``C * block`` positions (``C`` ranks), and each round into
``C`` contiguous *pieces*, piece ``r`` on rank ``r``. A rank's *shard* is its pieces of every round,
in position order. In the prefill (rounds in order, no grad) and the reverse replay (rounds in
reverse order, with grad) all ranks forward their piece of a round at the same time, layer by layer.
At each layer a rank's queries attend to

- its own piece, causally (computed locally), and
- every position before its piece: the earlier rounds on every rank, and the earlier pieces of this
  round. These keys stay where they are; the queries travel. The round's (folded, padded) queries are
  all-gathered; each rank attends every rank's queries to the part of its own shard that lies before
  them (one unmasked flash call per query rank) and sends each partial ``(out, lse)`` back to its
  query's rank (all-to-all), which merges them with its causal part by their log-sum-exp.

Backward mirrors it: ``(dout, out, lse)`` is all-gathered; each rank runs the flash backward of its
partials, which gives the gradient of its *own* keys/values locally (nothing of the size of the cache
travels) and its shares of every rank's query gradient, sent back all-to-all and summed in rank order.

Why the gradient is exact with rounds in reverse order: a piece's keys/values are read by later
positions only. Before round ``k`` replays, every later round has replayed and the responses have
run, so the gradient its keys/values received from them sits complete in the gradient shard; that is
the seed its backward starts from. The gradient from the later pieces of round ``k`` itself arrives
inside the same backward: the rank holding the piece computes it (its served partials) at each layer
and returns it as the gradient of the piece's keys/values. A round is layer-synchronous, so every
rank issues the same collectives in the same order (two per layer forward, two backward), whatever
its responses.

Load balance: every rank holds ``1/C`` of every stretch of the prompt (a striped layout), so the
attention to earlier rounds, the bulk at long context, splits evenly; within a round the rank holding
an earlier piece serves the later pieces' queries over it, and odd rounds reverse the pieces' rank
order (zigzag) so that this extra work alternates between the ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import attention
from ..attention.split import _expand, _fold, _reduce, _unfold
from ..errors import UnsupportedModelError

__all__ = ["Round", "chunk_bounds", "rounds", "served_backward", "served_forward"]

SINGLE_DEVICE = "TreeExecutor(model, mode='replay', prompt_grad='exact') (single-device long-context replay)"


def chunk_bounds(length: int, world: int) -> list[int]:
    """Contiguous chunks of ``length`` positions over ``world`` ranks, sizes differing by at most one.

    Returns:
        ``world + 1`` offsets: rank ``r`` holds positions ``[bounds[r], bounds[r + 1])``.
    """
    base, extra = divmod(length, world)
    bounds = [0]
    for r in range(world):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return bounds


@dataclass(frozen=True)
class Round:
    """One round of the parallel schedule.

    Attributes:
        pieces: per rank, the ``(start, end)`` prompt positions it computes in this round (non-empty).
        offsets: per rank, where this round's piece begins in that rank's shard.
    """

    pieces: tuple[tuple[int, int], ...]
    offsets: tuple[int, ...]

    @property
    def longest(self) -> int:
        return max(b - a for a, b in self.pieces)

    def visible(self, server: int, reader: int) -> int:
        """How many positions of ``server``'s shard lie before ``reader``'s piece of this round."""
        a, b = self.pieces[server]
        return self.offsets[server] + (b - a if a < self.pieces[reader][0] else 0)

    @property
    def last(self) -> int:
        """The rank whose piece ends the round."""
        return max(range(len(self.pieces)), key=lambda r: self.pieces[r][1])


def rounds(cached: int, world: int, block: int | None) -> list[Round]:
    """Split ``cached`` prompt positions into rounds of about ``world * block`` (None: one round).

    Every piece is non-empty (at most ``cached // world`` rounds), so every rank runs every round; a
    round's odd positions go to the ranks holding fewest so far, so shards differ by at most one.
    Odd rounds lay their pieces out in reverse rank order (zigzag): the rank that serves the round's
    later pieces in one round is served in the next, so the in-round work evens out.
    """
    per_round = world * block if block else cached
    count = max(1, min(-(-cached // per_round), cached // world))
    edges = chunk_bounds(cached, count)
    out, held = [], [0] * world
    for a, b in zip(edges, edges[1:], strict=False):
        base, extra = divmod(b - a, world)
        plus = set(sorted(range(world), key=lambda r: (held[r], r))[:extra])
        pieces, start = [None] * world, a
        for r in range(world) if len(out) % 2 == 0 else reversed(range(world)):
            pieces[r] = (start, start + base + (r in plus))
            start = pieces[r][1]
        out.append(Round(tuple(pieces), tuple(held)))
        held = [h + (q - p) for h, (p, q) in zip(held, pieces, strict=True)]
    return out


def kernels(t: torch.Tensor) -> tuple:
    """The flash forward/backward kernels for ``t``'s device and dtype, or a refusal naming replay."""
    found = attention.kernels_for(t.device, t.dtype, t.shape[-1])
    if found is None:
        raise UnsupportedModelError(
            f"context-parallel replay needs flash-attention kernels for {t.dtype} on {t.device.type} (CPU: any "
            "float dtype; CUDA: bf16/fp16): use " + SINGLE_DEVICE
        )
    return found


def served_forward(
    keys: torch.Tensor,
    values: torch.Tensor,
    q_fold: torch.Tensor,
    n: int,
    scale: float,
    pack_dtype: torch.dtype,
) -> torch.Tensor:
    """Folded queries ``[1, kv, m, d]`` over the first ``n`` shard positions (``keys``, ``values``:
    ``[1, kv, S, d]``), unmasked: the partial ``[1, kv, m, d + 1]`` (out, lse); zeros and ``-inf``
    where ``n == 0``."""
    d = q_fold.shape[-1]
    if n == 0:
        out = torch.zeros(*q_fold.shape[:-1], d + 1, dtype=pack_dtype, device=q_fold.device)
        out[..., d] = -math.inf
        return out
    k, v = keys[:, :, :n].to(q_fold.dtype), values[:, :, :n].to(q_fold.dtype)
    o, lse = kernels(q_fold)[0](q_fold, k, v, 0.0, False, scale=scale)
    return torch.cat([o.to(pack_dtype), lse.to(pack_dtype)[..., None]], -1)


def served_backward(
    keys: torch.Tensor, values: torch.Tensor, q_fold: torch.Tensor, pack: torch.Tensor, n: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The flash backward of :func:`served_forward` (``pack``: folded ``dout``, ``out``, ``lse``,
    ``[1, kv, m, 2d + 1]``): the query gradient ``[1, kv, m, d]`` and the key/value gradient of the
    first ``n`` shard positions ``[1, kv, n, d]`` (None where ``n == 0``)."""
    d = q_fold.shape[-1]
    if n == 0:
        return torch.zeros_like(q_fold), None, None
    dt = q_fold.dtype
    dout, out, lse = pack[..., :d].to(dt), pack[..., d : 2 * d].to(dt), pack[..., 2 * d].contiguous()
    k, v = keys[:, :, :n].to(dt), values[:, :, :n].to(dt)
    return kernels(q_fold)[1](dout.contiguous(), q_fold, k, v, out.contiguous(), lse, 0.0, False, scale=scale)


def _padded(t: torch.Tensor, m: int) -> torch.Tensor:
    """``[b, h, n, ...]`` -> ``[b, h, m, ...]``, zero rows appended (every rank sends equal sizes)."""
    n = t.shape[2]
    if n == m:
        return t
    pad = torch.zeros(*t.shape[:2], m - n, *t.shape[3:], dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], 2)


class RoundAttention(torch.autograd.Function):
    """One layer's attention of this rank's piece of a round (module docstring), with every rank.

    ``session`` is the pass's state (:class:`~forkrl.core.executor.context_parallel._Session`):
    its group, rank, shards (``keys``/``values``, ``key_grads``/``value_grads`` per layer
    ``[1, kv, S, d]``), compute and pack dtypes, and the current ``round``.
    """

    @staticmethod
    def forward(ctx, q, k, v, session, layer: int, scale: float):  # noqa: D102
        s, rd = session, session.round
        b, h, n, d = q.shape
        kv, m = k.shape[1], rd.longest
        rep = h // kv
        q, k, v = (t.to(s.dtype) for t in (q, k, v))
        q = q.contiguous()
        off = rd.offsets[s.rank]
        s.keys[layer][:, :, off : off + n] = k.detach()  # served to later pieces of this round
        s.values[layer][:, :, off : off + n] = v.detach()
        mine = _fold(_padded(q, m), kv).contiguous()
        queries = [torch.empty_like(mine) for _ in range(s.world)]
        gathering = dist.all_gather(queries, mine, group=s.group, async_op=True)
        # While the queries travel: this piece's causal part and its own queries' served part.
        out, lse = kernels(q)[0](q, _expand(k, rep), _expand(v, rep), 0.0, True, scale=scale)
        out, lse = out.to(s.pack_dtype), lse.to(s.pack_dtype)
        own = served_forward(
            s.keys[layer], s.values[layer], mine, rd.visible(s.rank, s.rank), scale, s.pack_dtype
        )
        gathering.wait()
        parts = [
            own
            if j == s.rank
            else served_forward(
                s.keys[layer], s.values[layer], queries[j], rd.visible(s.rank, j), scale, s.pack_dtype
            )
            for j in range(s.world)
        ]
        received = [torch.empty_like(parts[0]) for _ in range(s.world)]
        dist.all_to_all(received, parts, group=s.group)
        for p in received:  # rank order on every rank: the same rounding whatever the layout
            o_j = _unfold(p[..., :d], b, h, m)[:, :, :n]
            l_j = _unfold(p[..., d], b, h, m)[:, :, :n]
            merged = torch.logaddexp(lse, l_j)
            out = out * torch.exp(lse - merged)[..., None] + o_j * torch.exp(l_j - merged)[..., None]
            lse = merged
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *queries)
        ctx.session, ctx.layer, ctx.scale = s, layer, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        s, layer, scale = ctx.session, ctx.layer, ctx.scale
        rd = s.round
        q, k, v, out, lse, *queries = ctx.saved_tensors
        b, h, n, d = q.shape
        kv, m = k.shape[1], rd.longest
        rep = h // kv
        dout = dout.to(q.dtype).contiguous()
        pd = s.pack_dtype
        pack = torch.cat(
            [
                _fold(_padded(dout, m), kv).to(pd),
                _fold(_padded(out, m), kv).to(pd),
                _fold(_padded(lse[..., None], m), kv).to(pd),
            ],
            -1,
        ).contiguous()
        packs = [torch.empty_like(pack) for _ in range(s.world)]
        gathering = dist.all_gather(packs, pack, group=s.group, async_op=True)
        # While the packs travel: this piece's causal backward.
        dq, dk, dv = kernels(q)[1](
            dout, q, _expand(k, rep), _expand(v, rep), out, lse, 0.0, True, scale=scale
        )
        dk, dv = _reduce(dk, rep), _reduce(dv, rep)
        gathering.wait()
        off = rd.offsets[s.rank]
        shares = []
        for j in range(s.world):
            vis = rd.visible(s.rank, j)
            dq_j, dk_j, dv_j = served_backward(
                s.keys[layer], s.values[layer], queries[j], packs[j], vis, scale
            )
            if dk_j is not None:
                earlier = min(vis, off)  # earlier rounds: their replay comes later, from the shard
                if earlier:
                    s.key_grads[layer][:, :, :earlier] += dk_j[:, :, :earlier].to(s.key_grads[layer].dtype)
                    s.value_grads[layer][:, :, :earlier] += dv_j[:, :, :earlier].to(
                        s.value_grads[layer].dtype
                    )
                if vis > off:  # this piece, read by a later piece of the round: its gradient now
                    dk = dk + dk_j[:, :, off:vis].to(dk.dtype)
                    dv = dv + dv_j[:, :, off:vis].to(dv.dtype)
            shares.append(dq_j.contiguous())
        received = [torch.empty_like(shares[0]) for _ in range(s.world)]
        dist.all_to_all(received, shares, group=s.group)
        dq_fold = received[0]
        for r in received[1:]:
            dq_fold = dq_fold + r
        dq = dq + _unfold(dq_fold, b, h, m)[:, :, :n]
        return dq, dk, dv, None, None, None
