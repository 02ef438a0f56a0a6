"""Context-parallel long-context replay: one long prompt's cache sharded over a group of ranks.

Single-device long-context replay (``TreeExecutor(model, mode="replay", prompt_grad="exact")``)
keeps the whole prompt's key/value cache and its gradient on one device. Here a prompt of ``P``
tokens is split into ``C`` contiguous chunks over a process group (gloo on the CPU, NCCL on GPUs);
rank ``r`` keeps only the keys/values of its chunk (its *shard*) and their gradient. The model is
replicated on every rank.

Every forward runs on one rank, its *owner*, with forkrl's attention function ``forkrl_cp``
selected: at each layer the owner broadcasts its queries, every rank attends them to the part of
its shard that lies before the unit (an unmasked flash-attention call: ``(out_j, lse_j)``), and the
owner merges those partials with the unit's own causal attention by their log-sum-exp, as
:mod:`forkrl.core.attention.split` merges a node's cache pieces::

    lse = logsumexp_j lse_j,    out = sum_j out_j * exp(lse_j - lse)

In backward the owner broadcasts ``(dout, out, lse)``; each rank runs the flash backward of its own
partial, which gives its shard's key/value gradient *locally* (added to its gradient shard: no
gradient of any key ever travels) and its share of the query gradient, summed back to the owner.
This is ring attention's identity with the roles turned round: the queries travel, the cache stays.

Steps of :meth:`ContextParallelReplay.backward` (one *unit* = one block of a chunk, or one response):

1. **Prefill** (no grad): chunk 0's blocks in order on rank 0, then chunk 1's on rank 1, ...; each
   owner writes the block's keys/values into its shard.
2. **Responses** (with grad), each run by the rank that passed it (one at a time), with the last
   prompt token in front (its row predicts the first response token; the cached prompt is the
   first ``P - 1`` tokens). Its head gradient and its shards' key/value gradient follow at once.
3. **Reverse replay** (``prompt_grad="exact"``): the blocks in reverse position order, the last
   chunk's first, each re-forwarded with grad on its owner and backpropagated with the gradient its
   keys/values accumulated (from the responses and from every later block); the gradient of the
   earlier chunks' keys/values lands on their ranks, in their gradient shards, by step 3's served
   backward. By the time a block runs, every later position has run: its gradient is complete.
4. The parameter gradients (each owner's units') are summed over the group: every rank ends with
   the whole step's gradient, ``d/dθ sum_i sum_t coef_i[t] * logprob_i[t]`` over all the group's
   responses, as single-device replay of the same prompt and responses gives.

Every rank walks the same schedule (the response lengths are all-gathered once), and every unit
issues, per layer, one broadcast and one gather forward and one broadcast and one reduce backward,
on every rank: the collective sequence does not depend on which rank holds which response.

Memory and communication per rank, beside single-device replay (``L`` layers, ``kv`` key/value
heads of width ``d``, ``H`` query heads, ``b`` bytes per element, block ``n``, group ``C``):

=========================  =================================  =====================================
                           single device                      context parallel, per rank
=========================  =================================  =====================================
kept cache                 ``P * L * 2 * kv * d * b``         ``ceil((P-1)/C) * L * 2 * kv * d * b``
cache gradient (exact)     same as the cache                  same as the shard
activations                one block's or one response's      the same (the owner's unit), plus the
                                                              unit's folded queries per layer on
                                                              serving ranks (``n * L * H * d * b``)
communication per unit     none                               per layer: queries ``n*H*d``, partials
                                                              ``C * n*H*(d+1)`` gathered at the owner;
                                                              backward ``n*H*(2d+1)`` broadcast and
                                                              ``n*H*d`` reduced
compute                    one prefill, one replay            the same total, run by the owners in
                                                              position order (the group's memory,
                                                              not its speed, is what grows)
=========================  =================================  =====================================

Communication is in the queries, not the keys: per unit it does not grow with the prompt, and
over the whole prompt it is ``O(P * L * H * d)`` per rank, the same order as an all-gather of the
cache. The ranks serve in turn (an owner computes, the others serve its attention): wall time is
single-device replay's plus the collectives; overlapping the owners (ring-style simultaneous chunks)
is a follow-up.

Supported models: attention-only decoders whose layers all attend fully (Llama, Qwen2/3, Mistral
without a sliding window, ...; MHA, GQA, MQA). Hybrid and recurrent models (state passed from chunk
to chunk), sliding-window, multi-head latent attention, attention softcapping and dropout are
refused with :class:`UnsupportedModelError` naming single-device long-context replay.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .. import attention, compat
from ..attention.split import _expand, _fold, _reduce, _unfold
from ..errors import UnsupportedModelError
from .model import ModelAdapter

__all__ = ["CP_ATTENTION", "ContextParallelReplay", "ContextParallelResult", "chunk_bounds"]

CP_ATTENTION = "forkrl_cp"

_SINGLE_DEVICE = "TreeExecutor(model, mode='replay', prompt_grad='exact') (single-device long-context replay)"
_registered = False
_ACTIVE: _Session | None = None


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


@dataclass
class ContextParallelResult:
    """What a context-parallel pass returns on each rank.

    Attributes:
        logprobs: one detached ``[R_i]`` tensor per response this rank passed.
        shard_bytes: bytes of this rank's kept key/value shard (all layers).
        shard_grad_bytes: bytes of its key/value gradient shard (0 with ``prompt_grad="none"``).
        chunk: ``(start, end)`` prompt positions this rank's shard holds.
    """

    logprobs: list[torch.Tensor]
    shard_bytes: int
    shard_grad_bytes: int
    chunk: tuple[int, int]


@dataclass
class _Unit:
    owner: int  # group rank that runs the forward
    start: int  # position of its first token
    length: int
    grad: bool


@dataclass
class _Session:
    """The state ``forkrl_cp`` attention reads during a pass (set for the pass's duration only)."""

    group: object
    rank: int
    world: int
    global_ranks: list[int]
    bounds: list[int]  # chunk offsets of the cached prompt (P - 1 positions)
    keys: list[torch.Tensor]  # per layer [1, kv, chunk, d]
    values: list[torch.Tensor]
    key_grads: list[torch.Tensor] | None  # same shapes, or None (prompt_grad="none")
    value_grads: list[torch.Tensor] | None
    heads: int
    kv_heads: int
    dtype: torch.dtype
    head_dim: int
    unit: _Unit | None = None
    last_hidden: torch.Tensor | None = None  # [hidden] the prompt's last row (truncated gradient)
    next_layer: int = 0
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    saved_queries: dict[int, torch.Tensor] = field(default_factory=dict)  # serving ranks, grad units

    @property
    def pack_dtype(self) -> torch.dtype:
        return torch.promote_types(self.dtype, torch.float32)

    def visible(self) -> int:
        """How many of this rank's shard positions lie before the current unit."""
        lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        return max(0, min(self.unit.start - lo, hi - lo))

    def owner_global(self) -> int:
        return self.global_ranks[self.unit.owner]

    def shape(self, width: int) -> tuple[int, int, int, int]:
        """Folded ``[1, kv, n * H / kv, width]`` of the current unit."""
        return 1, self.kv_heads, self.unit.length * (self.heads // self.kv_heads), width

    # ------------------------------------------------------------------ served partials (every rank)
    def partial_forward(self, layer: int, q_fold: torch.Tensor, scale: float) -> torch.Tensor:
        """``[1, kv, m, d + 1]``: this rank's partial ``(out, lse)`` of folded queries over its
        visible shard (zeros and ``-inf`` where nothing is visible)."""
        n = self.visible()
        d = q_fold.shape[-1]
        if n == 0:
            out = torch.zeros(*q_fold.shape[:-1], d + 1, dtype=self.pack_dtype, device=q_fold.device)
            out[..., d] = -math.inf
            return out
        k = self.keys[layer][:, :, :n].to(q_fold.dtype)
        v = self.values[layer][:, :, :n].to(q_fold.dtype)
        o, lse = _kernels(q_fold)[0](q_fold, k, v, 0.0, False, scale=scale)
        return torch.cat([o.to(self.pack_dtype), lse.to(self.pack_dtype)[..., None]], -1)

    def partial_backward(
        self, layer: int, q_fold: torch.Tensor, pack: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """This rank's share of the query gradient ``[1, kv, m, d]``; its shard's key/value gradient
        is added to its gradient shard here (``pack``: folded ``dout``, ``out``, ``lse``)."""
        n = self.visible()
        d = q_fold.shape[-1]
        if n == 0:
            return torch.zeros_like(q_fold)
        dt = q_fold.dtype
        dout, out, lse = pack[..., :d].to(dt), pack[..., d : 2 * d].to(dt), pack[..., 2 * d].contiguous()
        k = self.keys[layer][:, :, :n].to(dt)
        v = self.values[layer][:, :, :n].to(dt)
        dq, dk, dv = _kernels(q_fold)[1](
            dout.contiguous(), q_fold, k, v, out.contiguous(), lse, 0.0, False, scale=scale
        )
        if self.key_grads is not None:
            self.key_grads[layer][:, :, :n] += dk.to(self.key_grads[layer].dtype)
            self.value_grads[layer][:, :, :n] += dv.to(self.value_grads[layer].dtype)
        return dq

    # ------------------------------------------------------------------ a serving rank's side of a unit
    def serve(self, layers: int, scale: float, device: torch.device) -> None:
        """Serve the owner's ``layers`` attention calls (and their backward for a grad unit)."""
        for layer in range(layers):
            q_fold = torch.empty(self.shape(self.head_dim), dtype=self.dtype, device=device)
            dist.broadcast(q_fold, self.owner_global(), group=self.group)
            part = self.partial_forward(layer, q_fold, scale)
            dist.gather(part, None, dst=self.owner_global(), group=self.group)
            if self.unit.grad:
                self.saved_queries[layer] = q_fold
        if not self.unit.grad:
            return
        for layer in reversed(range(layers)):
            q_fold = self.saved_queries.pop(layer)
            pack = torch.empty(self.shape(2 * self.head_dim + 1), dtype=self.pack_dtype, device=device)
            dist.broadcast(pack, self.owner_global(), group=self.group)
            dq = self.partial_backward(layer, q_fold, pack, scale).contiguous()
            dist.reduce(dq, self.owner_global(), op=dist.ReduceOp.SUM, group=self.group)


def _kernels(t: torch.Tensor) -> tuple:
    kernels = attention.kernels_for(t.device, t.dtype, t.shape[-1])
    if kernels is None:
        raise UnsupportedModelError(
            f"context-parallel replay needs flash-attention kernels for {t.dtype} on {t.device.type} (CPU: any "
            "float dtype; CUDA: bf16/fp16): use " + _SINGLE_DEVICE
        )
    return kernels


class _ServedAttention(torch.autograd.Function):
    """The owner's attention at one layer: its own causal part plus every rank's served partial."""

    @staticmethod
    def forward(ctx, q, k, v, layer: int, scale: float):  # noqa: D102
        s: _Session = _ACTIVE
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
        part = s.partial_forward(layer, q_fold, scale)
        parts = [torch.empty_like(part) for _ in range(s.world)]
        dist.gather(part, parts, dst=s.owner_global(), group=s.group)
        for p in parts:  # rank order on every owner: the same rounding whoever owns the unit
            o_j, l_j = _unfold(p[..., :d], b, h, n), _unfold(p[..., d], b, h, n)
            merged = torch.logaddexp(lse, l_j)
            out = out * torch.exp(lse - merged)[..., None] + o_j * torch.exp(l_j - merged)[..., None]
            lse = merged
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, q_fold)
        ctx.layer, ctx.scale = layer, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        s: _Session = _ACTIVE
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
        dq_fold = s.partial_backward(ctx.layer, q_fold, pack, ctx.scale).contiguous()
        dist.reduce(dq_fold, s.owner_global(), op=dist.ReduceOp.SUM, group=s.group)
        dq = dq + _unfold(dq_fold, b, h, n)
        return dq, _reduce(dk, rep), _reduce(dv, rep), None, None


def cp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function of a context-parallel unit (owner side).

    Args:
        query: ``[1, H, n, d]``; key, value: ``[1, kv, n, d]`` (the unit's own, after RoPE).
        attention_mask: ignored: a unit is one unpadded run, causal over itself and unmasked over the
            shards' positions before it.

    Returns:
        ``[1, n, H, d]`` attention output, and None for the weights.
    """
    s = _ACTIVE
    if s is None or s.unit is None:
        raise RuntimeError(
            f"{CP_ATTENTION} attention was called outside a context-parallel pass; a forkrl bug"
        )
    layer = getattr(module, "layer_idx", s.next_layer)
    if layer != s.next_layer or dropout > 0.0 or kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise RuntimeError(
            f"context-parallel replay expected layer {s.next_layer}'s full attention without dropout, got layer "
            f"{layer} (dropout {dropout}): the ranks' collectives would no longer match; use "
            + _SINGLE_DEVICE
        )
    s.next_layer += 1
    s.recorded[layer] = (key, value)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _ServedAttention.apply(query, key, value, layer, scale)
    return out.transpose(1, 2).contiguous(), None


def _check_model(adapter: ModelAdapter) -> None:
    kinds = sorted(set(adapter.layer_kinds))
    why = None
    if kinds != ["full"]:
        why = f"has cache layers of kind {kinds} (context-parallel replay runs attention-only models whose layers all attend fully; recurrent state passed chunk to chunk is not implemented)"
    elif adapter.mla_modules:
        why = "uses multi-head latent attention"
    elif getattr(adapter.config, "attn_logit_softcapping", None) is not None:
        why = "softcaps its attention logits"
    elif adapter.has_dropout():
        why = "draws dropout masks in this mode (call model.eval() or set the dropout to 0)"
    if why is not None:
        raise UnsupportedModelError(
            f"{adapter.name} {why}, so it cannot run context-parallel replay: use {_SINGLE_DEVICE}"
        )


class ContextParallelReplay:
    """Long-context replay of one prompt and its responses over a context-parallel process group.

    Every rank holds the whole model and calls :meth:`backward` with the same prompt and its own
    responses (the group's responses split over the ranks in any way, an empty list included).

    Args:
        model: a transformers causal LM, attention-only (module docstring), the same on every rank.
        group: the context-parallel process group (None: the default group).
        block_size: the longest span of a chunk forwarded at once (None: the whole chunk).
        prompt_grad: ``"exact"``: the reverse replay gives the prompt its gradient; ``"none"``: the
            truncated gradient of single-device replay's ``prompt_grad="none"``: the whole prompt is a
            constant (all ``P`` positions cached, no gradient shard, no replay); only the LM head
            learns from the prompt's last row, which predicts each response's first token.
        temperature: logits are divided by it before the softmax.
        reduce_grads: sum the parameter gradients over the group at the end (every rank then holds
            the whole step's gradient); False leaves each rank its own units' share.

    Raises:
        UnsupportedModelError: for models it cannot run, naming single-device long-context replay.
        ValueError: on a bad block size, prompt_grad or temperature.
    """

    def __init__(
        self,
        model: nn.Module,
        group=None,
        block_size: int | None = None,
        prompt_grad: str = "exact",
        temperature: float = 1.0,
        reduce_grads: bool = True,
    ) -> None:
        if block_size is not None and (
            isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
        ):
            raise ValueError(f"block_size={block_size!r} must be a positive integer or None")
        if prompt_grad not in ("exact", "none"):
            raise ValueError(f"prompt_grad={prompt_grad!r} must be one of ('exact', 'none')")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature={temperature!r} must be a positive finite number")
        self.model = model
        self.adapter = ModelAdapter(model)
        _check_model(self.adapter)
        self.group = group
        self.block_size = block_size
        self.prompt_grad = prompt_grad
        self.temperature = float(temperature)
        self.reduce_grads = reduce_grads
        cfg = self.adapter.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads

    @property
    def device(self) -> torch.device:
        return self.adapter.head.weight.device

    # ------------------------------------------------------------------ public API
    def backward(
        self,
        prompt: torch.Tensor | Sequence[int],
        responses: Sequence[torch.Tensor | Sequence[int]],
        coefficients: Sequence[torch.Tensor],
    ) -> ContextParallelResult:
        """Accumulate into ``param.grad`` the gradient of ``sum_i sum_t coefficients[i][t] * logprob_i[t]``
        over every rank's responses (each rank: its own), exactly as single-device replay would.

        A collective over the group: every rank calls it with the same prompt.

        Args:
            prompt: ``[P]`` token ids, ``P - 1`` at least the group's size.
            responses: this rank's responses, ``[R_i]`` token ids each (``R_i >= 1``).
            coefficients: ``[R_i]`` per response, the gradient of the objective in its log-probs.

        Returns:
            :class:`ContextParallelResult` (this rank's log-probs, its shard's bytes).
        """
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "ContextParallelReplay.backward was called with grad mode off: call it outside torch.no_grad()"
            )
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        prompt = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
        responses = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in responses]
        if len(coefficients) != len(responses):
            raise ValueError(f"{len(responses)} responses but {len(coefficients)} coefficient tensors")
        for i, (r, c) in enumerate(zip(responses, coefficients, strict=True)):
            if len(r) < 1 or c.shape != r.shape:
                raise ValueError(
                    f"response {i}: {len(r)} tokens (need >= 1) and coefficients of shape {tuple(c.shape)}"
                )
        cached = len(prompt) - (1 if self.prompt_grad == "exact" else 0)
        if cached < world:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens cannot be split over {world} ranks: need {cached} >= {world}"
            )
        lengths: list = [None] * world
        dist.all_gather_object(lengths, [len(r) for r in responses], group=self.group)
        session = self._session(cached, rank, world)
        pre = self._stash_grads()
        try:
            with self._active(session):
                logprobs = self._steps(session, prompt, responses, coefficients, lengths)
        finally:
            self._restore_grads(pre)
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        grad_bytes = nbytes(session.key_grads) + nbytes(session.value_grads) if session.key_grads else 0
        return ContextParallelResult(
            logprobs=logprobs,
            shard_bytes=nbytes(session.keys) + nbytes(session.values),
            shard_grad_bytes=grad_bytes,
            chunk=(session.bounds[rank], session.bounds[rank + 1]),
        )

    # ------------------------------------------------------------------ the steps
    def _steps(self, s: _Session, prompt, responses, coefficients, lengths) -> list[torch.Tensor]:
        for owner in range(s.world):  # 1. prefill, in position order
            for start, end in self._blocks(s, owner):
                self._unit(s, _Unit(owner, start, end - start, grad=False), prompt[start:end])
        if self.prompt_grad == "none":  # the last prompt row, a constant, predicts each first token
            if s.last_hidden is None:
                h = self.adapter.config.hidden_size
                s.last_hidden = torch.empty(h, dtype=self.adapter.head.weight.dtype, device=self.device)
            dist.broadcast(s.last_hidden, s.global_ranks[s.world - 1], group=s.group)
        out = self._responses(s, prompt, responses, coefficients, lengths)
        if self.prompt_grad == "exact":  # 3. reverse replay, the last block first
            for owner in reversed(range(s.world)):
                for start, end in reversed(self._blocks(s, owner)):
                    self._unit(s, _Unit(owner, start, end - start, grad=True), prompt[start:end])
        if self.reduce_grads:  # 4. every rank: the whole step's gradient
            self._sum_grads()
        return out

    def _responses(self, s: _Session, prompt, responses, coefficients, lengths) -> list[torch.Tensor]:
        """2. Every rank's responses in turn, one at a time; exact: the last prompt token in front."""
        last = s.bounds[-1]
        out = []
        for owner in range(s.world):
            for i, n in enumerate(lengths[owner]):
                unit = _Unit(owner, last, n + len(prompt) - last, grad=True)
                if owner != s.rank:
                    self._unit(s, unit, None)
                    continue
                ids = torch.cat([prompt[last:], responses[i].to(prompt.device)])
                out.extend(self._unit(s, unit, ids, coefficients[i]))
        return out

    def _sum_grads(self) -> None:
        for p in self.model.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=self.group)

    def _unit(self, s: _Session, unit: _Unit, ids: torch.Tensor | None, coef: torch.Tensor | None = None):
        """Run one unit: forward on its owner (and its backward for a grad unit), served elsewhere."""
        s.unit, s.next_layer = unit, 0
        layers = self.adapter.num_layers
        scale = self._scale()
        if unit.owner != s.rank:
            s.serve(layers, scale, self.device)
            s.unit = None
            return []
        ids = ids.to(self.device).unsqueeze(0)
        pos = torch.arange(unit.start, unit.start + unit.length, device=self.device).unsqueeze(0)
        with torch.set_grad_enabled(unit.grad):
            hidden = self.adapter.hidden(ids, pos)  # [1, n, hidden]
        if s.next_layer != layers:
            raise RuntimeError(f"{self.adapter.name} ran {s.next_layer} attention calls, expected {layers}")
        recorded, s.recorded = s.recorded, {}
        result = []
        if unit.start < s.bounds[-1]:  # a prompt block: its keys/values into this rank's shard
            a, b = unit.start - s.bounds[s.rank], unit.start - s.bounds[s.rank] + unit.length
            if not unit.grad:
                for layer, (k, v) in recorded.items():
                    s.keys[layer][:, :, a:b] = k.detach()
                    s.values[layer][:, :, a:b] = v.detach()
                if unit.start + unit.length == s.bounds[-1]:
                    s.last_hidden = hidden[0, -1].detach().contiguous()
            else:
                outputs, grads = [hidden], [torch.zeros_like(hidden)]  # every layer's backward runs
                for layer, (k, v) in recorded.items():
                    outputs += [k, v]
                    grads += [s.key_grads[layer][:, :, a:b].clone(), s.value_grads[layer][:, :, a:b].clone()]
                torch.autograd.backward(outputs, grads)
        else:  # a response: its log-probs and their gradient
            if unit.start == s.bounds[-1] - 1 or self.prompt_grad == "exact":  # the unit's first row predicts
                rows, targets = hidden[0, :-1], ids[0, 1:]
            else:  # truncated: the prompt's last row (a constant) does; only the head learns from it
                rows, targets = torch.cat([s.last_hidden[None].to(hidden.dtype), hidden[0, :-1]]), ids[0]
            logits = self.adapter.logits(rows, self.temperature)
            wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
            lp = torch.log_softmax(logits.to(wide), -1).gather(-1, targets[:, None])[:, 0]  # [R]
            torch.autograd.backward([lp], [coef.to(lp.dtype).to(lp.device)])
            result.append(lp.detach())
        s.unit = None
        return result

    def _blocks(self, s: _Session, owner: int) -> list[tuple[int, int]]:
        lo, hi = s.bounds[owner], s.bounds[owner + 1]
        step = self.block_size or (hi - lo)
        return [(a, min(a + step, hi)) for a in range(lo, hi, step)]

    def _scale(self) -> float:
        attn = next((m for m in self.model.modules() if hasattr(m, "scaling")), None)
        return float(attn.scaling) if attn is not None else self.head_dim**-0.5

    def _session(self, cached: int, rank: int, world: int) -> _Session:
        bounds = chunk_bounds(cached, world)
        n = bounds[rank + 1] - bounds[rank]
        dtype = attention.compute_dtype(self.device, self.adapter.head.weight.dtype)
        shape = (1, self.kv_heads, n, self.head_dim)

        def new() -> list[torch.Tensor]:
            return [
                torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.adapter.num_layers)
            ]

        exact = self.prompt_grad == "exact"
        group_ranks = (
            list(range(world))
            if self.group is None
            else [dist.get_global_rank(self.group, r) for r in range(world)]
        )
        s = _Session(
            group=self.group,
            rank=rank,
            world=world,
            global_ranks=group_ranks,
            bounds=bounds,
            keys=new(),
            values=new(),
            key_grads=new() if exact else None,
            value_grads=new() if exact else None,
            heads=self.heads,
            kv_heads=self.kv_heads,
            dtype=dtype,
            head_dim=self.head_dim,
        )
        return s

    @contextlib.contextmanager
    def _active(self, session: _Session) -> Iterator[None]:
        global _ACTIVE, _registered
        if not _registered:  # at first use, never at import
            compat.register_attention(CP_ATTENTION, cp_attention)
            _registered = True
        _ACTIVE = session
        try:
            with self.adapter.checkpointing_off(), self.adapter.attention_implementation(CP_ATTENTION):
                yield
        finally:
            _ACTIVE = None

    def _stash_grads(self) -> list[torch.Tensor | None]:
        """Set the existing gradients aside, so the group sum adds only this step's."""
        pre = [p.grad for p in self.model.parameters()]
        for p in self.model.parameters():
            p.grad = None
        return pre

    def _restore_grads(self, pre: list[torch.Tensor | None]) -> None:
        for p, g in zip(self.model.parameters(), pre, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
