"""The parallel schedule of context-parallel replay: every rank computes its part of the prompt at once.

:class:`~forkrl.core.executor.context_parallel.ContextParallelReplay` with ``schedule="parallel"``
splits the cached prompt into *rounds* of ``C * block`` positions (``C`` ranks), each round into
``2C`` contiguous *half-pieces*, and gives rank ``r`` the half-pieces ``r`` and ``2C - 1 - r``
(zigzag, as ring attention balances causal work): its *piece* of the round, one run of positions
with a gap. A rank's *shard* is its pieces of every round, in position order. In the prefill (rounds
in order, no grad) and the reverse replay (rounds in reverse order, with grad) all ranks forward
their piece of a round at the same time, layer by layer. At each layer a rank's queries attend to

- its own piece, causally (computed locally: the later half's positions follow the earlier half's,
  so a causal mask over the piece's run is exactly its own part), and
- every other position before them: the earlier rounds on every rank, and the other ranks'
  half-pieces of this round that come earlier. These keys stay where they are; the queries travel.
  The round's (folded, padded) queries are all-gathered; each rank attends every rank's queries to
  the part of its own shard that lies before them (an unmasked flash call per query half, one where
  both halves see the same part) and sends each partial ``(out, lse)`` back to its query's rank
  (all-to-all), which merges them with its causal part by their log-sum-exp.

Backward mirrors it: ``(dout, out, lse)`` is all-gathered; each rank runs the flash backward of its
partials, which gives the gradient of its *own* keys/values locally (nothing of the size of the cache
travels) and its shares of every rank's query gradient, sent back all-to-all and summed in rank order.

Why the gradient is exact with rounds in reverse order: a piece's keys/values are read by later
positions only. Before round ``k`` replays, every later round has replayed and the responses have
run, so the gradient its keys/values received from them sits complete in the gradient shard; that is
the seed its backward starts from. The gradient from the later half-pieces of round ``k`` itself
arrives inside the same backward: the rank holding the keys computes it (its served partials) at each
layer and returns it as the gradient of the piece's keys/values. A round is layer-synchronous, so
every rank issues the same collectives in the same order (two per layer forward, two backward),
whatever its responses.

Load balance, at every layer of every round (the group waits for its busiest rank at each
collective): every rank holds ``1/C`` of every earlier stretch of the prompt, so the attention to
earlier rounds, the bulk at long context, splits evenly; within the round, half-piece ``j``'s keys
are read by the ``2C - 1 - j`` later half-pieces, so rank ``r`` serves ``(2C - 1 - r) + r = 2C - 1``
half-piece pairs besides its own two causal ones, the same on every rank.

The responses run in rounds too (``Round.keeps`` False): round ``i`` is every rank's ``i``-th
response, each attending to every shard whole and to itself causally; its keys stay with it. A rank
with no ``i``-th response still issues the round's collectives, serving only (:func:`serve_round`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import attention
from ..attention.split import _expand, _fold, _reduce, _unfold, merge
from ..errors import UnsupportedModelError

__all__ = ["Round", "Span", "chunk_bounds", "rounds", "serve_round", "served_backward", "served_forward"]

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


Span = tuple[int, int]


@dataclass(frozen=True)
class Round:
    """One round of the parallel schedule.

    Attributes:
        pieces: per rank, the ``(start, end)`` prompt spans it computes in this round, in position
            order: its two half-pieces (one where the rank's share is a single position).
        offsets: per rank, where this round's piece begins in that rank's shard.
        keeps: its keys/values go into the shards (a prompt round); False: a round of responses,
            each rank's next one (none where it has no more), attending to every shard whole.
    """

    pieces: tuple[tuple[Span, ...], ...]
    offsets: tuple[int, ...]
    keeps: bool = True

    def length(self, rank: int) -> int:
        """Positions ``rank`` computes in this round."""
        return sum(b - a for a, b in self.pieces[rank])

    @property
    def longest(self) -> int:
        return max(self.length(r) for r in range(len(self.pieces)))

    def visible(self, server: int, reader: int) -> list[int]:
        """Per span of ``reader``'s piece, how many positions of ``server``'s shard lie before it
        that ``server`` serves (its own piece's are the reader's causal part when it reads itself)."""
        if server == reader:
            return [self.offsets[server]] * len(self.pieces[reader])
        return [
            self.offsets[server] + sum(b - a for a, b in self.pieces[server] if a < start)
            for start, _ in self.pieces[reader]
        ]

    @property
    def last(self) -> int:
        """The rank whose piece ends the round."""
        return max(range(len(self.pieces)), key=lambda r: self.pieces[r][-1][1])


def rounds(cached: int, world: int, block: int | None) -> list[Round]:
    """Split ``cached`` prompt positions into rounds of about ``world * block`` (None: one round).

    Every piece is non-empty (at most ``cached // world`` rounds), so every rank runs every round; a
    round's odd positions go to the ranks holding fewest so far, so shards differ by at most one.
    Each rank's share of a round is cut in two halves laid out zigzag (module docstring): ranks
    ``0 .. C-1`` take the round's first halves in order, ranks ``C-1 .. 0`` its second halves.
    """
    per_round = world * block if block else cached
    count = max(1, min(-(-cached // per_round), cached // world))
    edges = chunk_bounds(cached, count)
    out, held = [], [0] * world
    for a, b in zip(edges, edges[1:], strict=False):
        base, extra = divmod(b - a, world)
        plus = set(sorted(range(world), key=lambda r: (held[r], r))[:extra])
        sizes = [base + (r in plus) for r in range(world)]
        halves = [(n - n // 2, n // 2) for n in sizes]
        spans: list[list[Span]] = [[] for _ in range(world)]
        start = a
        for r, half in [(r, 0) for r in range(world)] + [(r, 1) for r in reversed(range(world))]:
            if halves[r][half]:
                spans[r].append((start, start + halves[r][half]))
                start += halves[r][half]
        out.append(Round(tuple(tuple(x) for x in spans), tuple(held)))
        held = [h + n for h, n in zip(held, sizes, strict=True)]
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


def _rows(t: torch.Tensor, rep: int, m: int, a: int, b: int) -> torch.Tensor:
    """Rows ``[a, b)`` of every query head's run of a folded, padded ``[1, kv, rep * m, w]``:
    ``[1, kv, rep * (b - a), w]`` (one sequence: the fold is head-major, ``m`` rows per head)."""
    kv, w = t.shape[1], t.shape[-1]
    return t.reshape(1, kv, rep, m, w)[:, :, :, a:b].reshape(1, kv, rep * (b - a), w)


def _runs(spans: tuple[Span, ...], visible: list[int]) -> list[tuple[int, int | None, int]]:
    """``(first row, end row, visible positions)`` of a reader's query rows per distinct visibility:
    one run of every row (end None: the padding too) when every span sees the same part of the
    server's shard, else one per span; none for a reader without a piece (a round of responses)."""
    if len(set(visible)) == 1:
        return [(0, None, visible[0])]
    out, row = [], 0
    for (a, b), n in zip(spans, visible, strict=True):
        out.append((row, row + b - a, n))
        row += b - a
    return out


def _serve(
    s, layer: int, q_fold: torch.Tensor, spans, visible, scale: float, rep: int, m: int
) -> torch.Tensor:
    """:func:`served_forward` of a reader's folded queries ``[1, kv, rep * m, d]``, per run of
    :func:`_runs`: the partial ``[1, kv, rep * m, d + 1]`` (padding rows: zeros, ``-inf``)."""
    keys, values, pd = s.keys[layer], s.values[layer], s.pack_dtype
    runs = _runs(spans, visible)
    if runs and runs[0][1] is None:
        return served_forward(keys, values, q_fold, runs[0][2], scale, pd)
    kv, d = q_fold.shape[1], q_fold.shape[-1]
    out = torch.zeros(1, kv, rep, m, d + 1, dtype=pd, device=q_fold.device)
    out[..., d] = -math.inf
    for a, b, n in runs:
        part = served_forward(keys, values, _rows(q_fold, rep, m, a, b), n, scale, pd)
        out[:, :, :, a:b] = part.reshape(1, kv, rep, b - a, d + 1)
    return out.reshape(1, kv, rep * m, d + 1)


def _serve_backward(
    s, layer: int, q_fold: torch.Tensor, pack: torch.Tensor, spans, visible, scale: float, rep: int, m: int
):
    """The backward of :func:`_serve`: the reader's query gradient share ``[1, kv, rep * m, d]`` and,
    per run, ``(n, dk, dv)`` the gradient of this shard's first ``n`` positions (None where n == 0)."""
    keys, values = s.keys[layer], s.values[layer]
    runs = _runs(spans, visible)
    if runs and runs[0][1] is None:
        dq, dk, dv = served_backward(keys, values, q_fold, pack, runs[0][2], scale)
        return dq, [(runs[0][2], dk, dv)]
    kv, d = q_fold.shape[1], q_fold.shape[-1]
    dq = torch.zeros(1, kv, rep, m, d, dtype=q_fold.dtype, device=q_fold.device)
    grads = []
    for a, b, n in runs:
        q_i, pack_i = _rows(q_fold, rep, m, a, b), _rows(pack, rep, m, a, b)
        dq_i, dk, dv = served_backward(keys, values, q_i, pack_i, n, scale)
        dq[:, :, :, a:b] = dq_i.reshape(1, kv, rep, b - a, d)
        grads.append((n, dk, dv))
    return dq.reshape(1, kv, rep * m, d), grads


class RoundAttention(torch.autograd.Function):
    """One layer's attention of this rank's piece of a round (module docstring), with every rank.

    ``session`` is the pass's state (:class:`~forkrl.core.executor.context_parallel._Session`):
    its group, rank, shards (``keys``/``values``, ``key_grads``/``value_grads`` per layer
    ``[1, kv, S, d]``), compute and pack dtypes, and the current ``round``. ``q``: ``[1, H, n, d]``,
    ``k``, ``v``: ``[1, kv, n, d]``, the piece's ``n`` positions (its spans, concatenated).
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
        if rd.keeps:  # served to later pieces of this round
            s.keys[layer][:, :, off : off + n] = k.detach()
            s.values[layer][:, :, off : off + n] = v.detach()
        mine = _fold(_padded(q, m), kv).contiguous()
        queries = [torch.empty_like(mine) for _ in range(s.world)]
        gathering = dist.all_gather(queries, mine, group=s.group, async_op=True)
        # While the queries travel: this piece's causal part and its own queries' served part.
        out, lse = kernels(q)[0](q, _expand(k, rep), _expand(v, rep), 0.0, True, scale=scale)
        out, lse = out.to(s.pack_dtype), lse.to(s.pack_dtype)
        serve = lambda j, q_j: _serve(s, layer, q_j, rd.pieces[j], rd.visible(s.rank, j), scale, rep, m)  # noqa: E731
        own = serve(s.rank, mine)
        gathering.wait()
        parts = [own if j == s.rank else serve(j, queries[j]) for j in range(s.world)]
        received = [torch.empty_like(parts[0]) for _ in range(s.world)]
        dist.all_to_all(received, parts, group=s.group)
        for p in received:  # rank order on every rank: the same rounding whatever the layout
            o_j = _unfold(p[..., :d], b, h, m)[:, :, :n]
            l_j = _unfold(p[..., d], b, h, m)[:, :, :n]
            out, lse = merge(out, lse, o_j, l_j)
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
        shares = _serve_all_backward(s, layer, queries, packs, scale, rep, m, dk, dv)
        received = [torch.empty_like(shares[0]) for _ in range(s.world)]
        dist.all_to_all(received, shares, group=s.group)
        dq_fold = received[0]
        for r in received[1:]:
            dq_fold = dq_fold + r
        dq = dq + _unfold(dq_fold, b, h, m)[:, :, :n]
        return dq, dk, dv, None, None, None


def _serve_all_backward(s, layer, queries, packs, scale, rep, m, dk=None, dv=None) -> list[torch.Tensor]:
    """The backward of every reader's served partials at one layer: their query gradient shares
    (``[1, kv, rep * m, d]`` each, in rank order); the gradient of this rank's keys/values of earlier
    rounds added to its gradient shard, and of this piece's (read by a later half-piece of the round)
    to ``dk``, ``dv`` ``[1, kv, n, d]``."""
    rd = s.round
    off = rd.offsets[s.rank]
    shares = []
    for j in range(s.world):
        spans, visible = rd.pieces[j], rd.visible(s.rank, j)
        dq_j, grads = _serve_backward(s, layer, queries[j], packs[j], spans, visible, scale, rep, m)
        for vis, dk_j, dv_j in grads:
            if dk_j is None:
                continue
            earlier = min(vis, off)  # earlier rounds: their replay comes later, from the shard
            if earlier and s.key_grads is not None:
                s.key_grads[layer][:, :, :earlier] += dk_j[:, :, :earlier].to(s.key_grads[layer].dtype)
                s.value_grads[layer][:, :, :earlier] += dv_j[:, :, :earlier].to(s.value_grads[layer].dtype)
            if vis > off:  # this piece's first vis - off positions, read by a later half-piece
                dk[:, :, : vis - off] += dk_j[:, :, off:vis].to(dk.dtype)
                dv[:, :, : vis - off] += dv_j[:, :, off:vis].to(dv.dtype)
        shares.append(dq_j.contiguous())
    return shares


def serve_round(s, scale: float, device: torch.device, grad: bool) -> None:
    """This rank's side of a round in which it has no piece (a round of responses where it has no
    more): the round's collectives, every layer forward and (``grad``) backward, serving the other
    ranks' queries over its shard and sending nothing of its own (zero queries, no rows read)."""
    rd = s.round
    kv, rep, d, m = s.kv_heads, s.heads // s.kv_heads, s.head_dim, rd.longest
    mine = torch.zeros(1, kv, rep * m, d, dtype=s.dtype, device=device)
    saved = {}
    for layer in s.attn_layers:
        queries = [torch.empty_like(mine) for _ in range(s.world)]
        dist.all_gather(queries, mine, group=s.group)
        parts = [
            _serve(s, layer, queries[j], rd.pieces[j], rd.visible(s.rank, j), scale, rep, m)
            for j in range(s.world)
        ]
        dist.all_to_all([torch.empty_like(parts[0]) for _ in range(s.world)], parts, group=s.group)
        saved[layer] = queries
    if not grad:
        return
    for layer in reversed(s.attn_layers):
        pack = torch.zeros(1, kv, rep * m, 2 * d + 1, dtype=s.pack_dtype, device=device)
        packs = [torch.empty_like(pack) for _ in range(s.world)]
        dist.all_gather(packs, pack, group=s.group)
        shares = _serve_all_backward(s, layer, saved.pop(layer), packs, scale, rep, m)
        dist.all_to_all([torch.empty_like(shares[0]) for _ in range(s.world)], shares, group=s.group)
