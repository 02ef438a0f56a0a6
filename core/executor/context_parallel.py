"""Context-parallel long-context replay: one long prompt's cache sharded over a group of ranks.

Single-device long-context replay (``TreeExecutor(model, mode="replay", prompt_grad="exact")``)
keeps the whole prompt's key/value cache and its gradient on one device. Here a prompt of ``P``
tokens is split into ``C`` contiguous chunks over a process group (gloo on the CPU, NCCL on GPUs);
rank ``r`` keeps only the keys/values of its chunk (its *shard*) and their gradient. The model is
replicated on every rank.

Two schedules. ``schedule="parallel"`` (the default, :mod:`.cp_rounds`) computes the prompt on every
rank at once: rounds of ``C * block_size`` positions, each rank a piece of each round (two
half-pieces, zigzag, so every rank does the same work at every layer), every rank's queries sent to
the shards that hold earlier positions (all-gather) and the partials sent back (all-to-all). ``schedule="serial"`` runs contiguous chunks on their owners in turn; the responses run
as below in both. What follows is the serial schedule's unit.

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
   owner writes the block's keys/values into its shard (hybrids: each block starts from the state
   the one before left, sent on at each chunk's end; the last chunk's final state to every rank).
2. **Responses** (with grad), each run by the rank that passed it (one at a time), with the last
   prompt token in front (its row predicts the first response token; the cached prompt is the
   first ``P - 1`` tokens). Its head gradient and its shards' key/value gradient follow at once.
   (The parallel schedule runs every rank's ``i``-th response at once, a round of responses.)
3. **Reverse replay** (``prompt_grad="exact"``): the blocks in reverse position order, the last
   chunk's first, each re-forwarded with grad on its owner and backpropagated with the gradient its
   keys/values accumulated (from the responses and from every later block); the gradient of the
   earlier chunks' keys/values lands on their ranks, in their gradient shards, by step 3's served
   backward. By the time a block runs, every later position has run: its gradient is complete.
   Hybrids: a block's state output gets the later block's (or the summed responses') gradient.
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
compute                    one prefill, one replay            serial: the same total, run by the owners
                                                              in turn (memory, not speed, grows);
                                                              parallel: ``1/C`` of it on each rank
=========================  =================================  =====================================

Communication is in the queries, not the keys: per unit it does not grow with the prompt, and
over the whole prompt it is ``O(P * L * H * d)`` per rank, the same order as an all-gather of the
cache. Serial: the ranks serve in turn (an owner computes, the others serve its attention), so wall
time is single-device replay's plus the collectives. Parallel: per round and layer, the round's
queries ``C * n*H*d`` all-gathered and ``C * n*H*(d+1)`` partials exchanged all-to-all (backward
``C * n*H*(2d+1)`` and ``C * n*H*d``), with ``n`` a piece (``block_size``); the compute splits ``C``
ways (the responses too: each rank runs its own, every rank's ``i``-th at once).

Supported models: decoders whose attention layers all attend fully (Llama, Qwen2/3, Mistral
without a sliding window, ...; MHA, GQA, MQA), and hybrid and recurrent ones (Qwen3-Next's linear
attention, Mamba-1/2 layers as in Jamba, Bamba, Falcon-H1, LFM2's convolutions, pure Mamba): their
conv/recurrent state passes from chunk to chunk in position order, forward and its gradient back
(:mod:`.cp_state`), under the serial schedule (``"parallel"`` falls back to it, logged). Sliding
windows, multi-head latent attention, attention softcapping and dropout are refused with
:class:`UnsupportedModelError` naming single-device long-context replay.
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
from ..collectives import all_reduce_buckets
from .cp_rounds import SINGLE_DEVICE as _SINGLE_DEVICE
from .cp_rounds import Round, RoundAttention, chunk_bounds, rounds, serve_round
from .cp_served import ServedAttention, serve
from .cp_state import ATTENTION_KINDS, StateCarry, check_model, schedule_for
from .model import ModelAdapter

__all__ = ["CP_ATTENTION", "ContextParallelReplay", "ContextParallelResult", "chunk_bounds"]

CP_ATTENTION = "forkrl_cp"

_registered = False
_ACTIVE: _Session | None = None


@dataclass
class ContextParallelResult:
    """What a context-parallel pass returns on each rank.

    Attributes:
        logprobs: one detached ``[R_i]`` tensor per response this rank passed.
        entropies: the same for the entropies of the predicting distributions, or None.
        shard_bytes: bytes of this rank's kept key/value shard (all layers).
        shard_grad_bytes: bytes of its key/value gradient shard (0 with ``prompt_grad="none"``).
        pieces: the ``(start, end)`` prompt spans this rank's shard holds, in shard order (the
            serial schedule: its one chunk; the parallel schedule: its piece of every round).
        state_bytes_sent: bytes of conv/recurrent state and state gradient it sent along the chain.
    """

    logprobs: list[torch.Tensor]
    entropies: list[torch.Tensor] | None
    shard_bytes: int
    shard_grad_bytes: int
    pieces: list[tuple[int, int]]
    state_bytes_sent: int = 0


@dataclass
class _Unit:
    owner: int  # group rank that runs the forward
    start: int  # position of its first token
    length: int
    grad: bool
    spans: tuple[tuple[int, int], ...] = ()  # a round's piece: its spans (else one run from start)

    @property
    def end(self) -> int:
        return self.spans[-1][1] if self.spans else self.start + self.length

    def positions(self, device: torch.device) -> torch.Tensor:
        """``[1, length]`` the positions of its tokens."""
        runs = self.spans or ((self.start, self.end),)
        return torch.cat([torch.arange(a, b, device=device) for a, b in runs])[None]


@dataclass
class _Work:
    """One pass's responses (this rank's) and their coefficients (None: a scoring pass)."""

    responses: list[torch.Tensor]
    coefficients: Sequence[torch.Tensor] | None
    entropy_coefficients: Sequence[torch.Tensor | None] | None  # scoring: Nones where entropies are asked
    lengths: list[list[int]]  # every rank's response lengths

    @property
    def grad(self) -> bool:
        return self.coefficients is not None

    def coefficients_of(self, i: int) -> tuple:
        """``(logprob coefficients or None, whether entropies are wanted or None, entropy coefficients or None)``."""
        ent = self.entropy_coefficients
        lp = self.coefficients[i] if self.coefficients is not None else None
        return lp, (True if ent is not None else None), (ent[i] if ent is not None else None)


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
    attn_layers: list[int]  # the layers with attention, in order (all of an attention-only model)
    carry: StateCarry  # the state chain (hybrids; a no-op for attention-only models)
    unit: _Unit | None = None
    layout: list[Round] = field(default_factory=list)  # the parallel schedule's rounds (serial: none)
    round: Round | None = None  # the parallel schedule's current round (None: a served unit)
    last_hidden: torch.Tensor | None = None  # [hidden] the prompt's last row (truncated gradient)
    next_layer: int = 0  # attention calls so far in the unit
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
    expected = s.attn_layers[s.next_layer] if s.next_layer < len(s.attn_layers) else None
    layer = getattr(module, "layer_idx", expected)
    if layer != expected or dropout > 0.0 or kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise RuntimeError(
            f"context-parallel replay expected layer {expected}'s full attention without dropout, got layer "
            f"{layer} (dropout {dropout}): the ranks' collectives would no longer match; use "
            + _SINGLE_DEVICE
        )
    s.next_layer += 1
    s.recorded[layer] = (key, value)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if s.round is not None:
        out = RoundAttention.apply(query, key, value, s, layer, scale)
    else:
        out = ServedAttention.apply(query, key, value, s, layer, scale)
    return out.transpose(1, 2).contiguous(), None


class ContextParallelReplay:
    """Long-context replay of one prompt and its responses over a context-parallel process group.

    Every rank holds the whole model and calls :meth:`backward` with the same prompt and its own
    responses (the group's responses split over the ranks in any way, an empty list included).

    Args:
        model: a transformers causal LM, attention-only (module docstring), the same on every rank.
        group: the context-parallel process group (None: the default group).
        block_size: the longest span a rank forwards at once (None: its whole chunk).
        schedule: ``"parallel"``: every rank computes its part of the prompt at the same time
            (:mod:`.cp_rounds`: rounds of ``C * block_size`` positions, each rank two half-pieces
            of each);
            ``"serial"``: contiguous chunks, computed by their owners in turn while the others serve
            (the group's memory, not its speed, grows with ``C``).
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
        schedule: str = "parallel",
    ) -> None:
        if block_size is not None and (
            isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
        ):
            raise ValueError(f"block_size={block_size!r} must be a positive integer or None")
        if schedule not in ("parallel", "serial"):
            raise ValueError(f"schedule={schedule!r} must be one of ('parallel', 'serial')")
        if prompt_grad not in ("exact", "none"):
            raise ValueError(f"prompt_grad={prompt_grad!r} must be one of ('exact', 'none')")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature={temperature!r} must be a positive finite number")
        self.model = model
        self.adapter = ModelAdapter(model)
        check_model(self.adapter)
        self.group = group
        self.block_size = block_size
        self.prompt_grad = prompt_grad
        self.temperature = float(temperature)
        self.reduce_grads = reduce_grads
        self.schedule = schedule_for(self.adapter, schedule)  # hybrids: "serial", logged
        cfg = self.adapter.config
        self.heads = getattr(cfg, "num_attention_heads", None) or 1  # a pure SSM has none (never read)
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
        entropy_coefficients: Sequence[torch.Tensor] | None = None,
    ) -> ContextParallelResult:
        """Accumulate into ``param.grad`` the gradient of ``sum_i sum_t coefficients[i][t] * logprob_i[t]``
        (plus the same with entropies) over every rank's responses (each rank: its own), exactly as
        single-device replay would.

        A collective over the group: every rank calls it with the same prompt.

        Args:
            prompt: ``[P]`` token ids, ``P - 1`` at least the group's size.
            responses: this rank's responses, ``[R_i]`` token ids each (``R_i >= 1``).
            coefficients: ``[R_i]`` per response, the gradient of the objective in its log-probs.
            entropy_coefficients: ``[R_i]`` per response, in its entropies (None: no entropy term).

        Returns:
            :class:`ContextParallelResult` (this rank's log-probs, its shard's bytes).
        """
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "ContextParallelReplay.backward was called with grad mode off: call it outside torch.no_grad()"
            )
        for name, coefs in (("coefficient", coefficients), ("entropy coefficient", entropy_coefficients)):
            if coefs is not None and len(coefs) != len(responses):
                raise ValueError(f"{len(responses)} responses but {len(coefs)} {name} tensors")
        return self._run(prompt, responses, coefficients, entropy_coefficients)

    def score(
        self,
        prompt: torch.Tensor | Sequence[int],
        responses: Sequence[torch.Tensor | Sequence[int]],
        entropy: bool = False,
    ) -> ContextParallelResult:
        """This rank's responses' log-probs (and entropies), without grad: the prefill and the
        responses' forwards, no replay. A collective, as :meth:`backward`."""
        with torch.no_grad():
            return self._run(prompt, responses, None, [None] * len(responses) if entropy else None)

    def _run(self, prompt, responses, coefficients, entropy_coefficients) -> ContextParallelResult:
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        prompt = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
        responses = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in responses]
        for i, r in enumerate(responses):
            shapes = [
                tuple(c[i].shape) for c in (coefficients, entropy_coefficients) if c and c[i] is not None
            ]
            if len(r) < 1 or any(shape != tuple(r.shape) for shape in shapes):
                raise ValueError(
                    f"response {i}: {len(r)} tokens (need >= 1) and coefficients of shapes {shapes}"
                )
        cached = len(prompt) - (1 if self.prompt_grad == "exact" else 0)
        if cached < world:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens cannot be split over {world} ranks: need {cached} >= {world}"
            )
        lengths: list = [None] * world
        dist.all_gather_object(lengths, [len(r) for r in responses], group=self.group)
        session = self._session(cached, rank, world)
        work = _Work(responses, coefficients, entropy_coefficients, lengths)
        pre = self._stash_grads() if work.grad else None
        try:
            with self._active(session):
                results = self._steps(session, prompt, work)
        finally:
            if pre is not None:
                self._restore_grads(pre)
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        grad_bytes = nbytes(session.key_grads) + nbytes(session.value_grads) if session.key_grads else 0
        return ContextParallelResult(
            logprobs=[lp for lp, _ in results],
            entropies=[ent for _, ent in results] if entropy_coefficients is not None else None,
            shard_bytes=nbytes(session.keys) + nbytes(session.values),
            shard_grad_bytes=grad_bytes,
            pieces=[span for rd in session.layout for span in rd.pieces[rank]]
            or [(session.bounds[rank], session.bounds[rank + 1])],
            state_bytes_sent=session.carry.bytes_sent,
        )

    # ------------------------------------------------------------------ the steps
    def _steps(self, s: _Session, prompt: torch.Tensor, work: _Work) -> list:
        self._prompt(s, prompt, grad=False)  # 1. prefill, in position order
        if self.prompt_grad == "none":  # the last prompt row, a constant, predicts each first token
            if s.last_hidden is None:
                h = self.adapter.config.hidden_size
                s.last_hidden = torch.empty(h, dtype=self.adapter.head.weight.dtype, device=self.device)
            last = s.layout[-1].last if s.layout else s.world - 1  # the rank that ran the last position
            dist.broadcast(s.last_hidden, s.global_ranks[last], group=s.group)
        out = self._responses(s, prompt, work)
        if not work.grad:  # scoring: no replay, no gradient
            return out
        if self.prompt_grad == "exact":  # 3. reverse replay, the last round or block first
            s.carry.sum_final_gradient()  # the responses' gradient of the prompt's final state
            self._prompt(s, prompt, grad=True)
        if self.reduce_grads:  # 4. every rank: the whole step's gradient
            self.sum_grads()
        return out

    def _prompt(self, s: _Session, prompt: torch.Tensor, grad: bool) -> None:
        """The prompt in position order (prefill) or reverse (replay, ``grad``): parallel, every rank
        its piece of each round at once; serial, each chunk's blocks on their owner in turn."""
        order = reversed if grad else list
        for rd in order(s.layout):
            spans = rd.pieces[s.rank]
            s.round = rd  # its attention is RoundAttention
            try:
                ids = torch.cat([prompt[a:b] for a, b in spans])
                self._unit(s, _Unit(s.rank, spans[0][0], len(ids), grad, spans), ids)
            finally:
                s.round = None
        if s.layout:
            return
        for owner in order(range(s.world)):
            for start, end in order(self._blocks(s, owner)):
                self._unit(s, _Unit(owner, start, end - start, grad=grad), prompt[start:end])
            s.carry.chunk_done(owner, grad, s.world)  # the state on to the next chunk (its gradient back)

    def _responses(self, s: _Session, prompt: torch.Tensor, work: _Work) -> list:
        """2. The responses, one at a time on each rank; exact: the last prompt token in front.
        Parallel schedule: every rank its ``i``-th at once (a round of responses); serial: in turn."""
        last, extra = s.bounds[-1], len(prompt) - s.bounds[-1]
        unit = lambda owner, i: _Unit(owner, last, work.lengths[owner][i] + extra, grad=work.grad)  # noqa: E731
        ids = lambda i: torch.cat([prompt[last:], work.responses[i].to(prompt.device)])  # noqa: E731
        out = []
        if s.layout:
            shards = tuple(b - a for a, b in zip(s.bounds, s.bounds[1:], strict=False))
            for i in range(max(len(lengths) for lengths in work.lengths)):
                spans = [
                    ((last, last + work.lengths[r][i] + extra),) if i < len(work.lengths[r]) else ()
                    for r in range(s.world)
                ]
                s.round = Round(tuple(spans), shards, keeps=False)  # every shard whole before each
                try:
                    if spans[s.rank]:
                        out.extend(self._unit(s, unit(s.rank, i), ids(i), work.coefficients_of(i)))
                    else:
                        serve_round(s, self._scale(), self.device, work.grad)
                finally:
                    s.round = None
            return out
        for owner in range(s.world):
            for i in range(len(work.lengths[owner])):
                if owner != s.rank:
                    self._unit(s, unit(owner, i), None)
                else:
                    out.extend(self._unit(s, unit(owner, i), ids(i), work.coefficients_of(i)))
        return out

    def sum_grads(self) -> None:
        """Sum ``param.grad`` over the group (every rank then holds the group's whole gradient)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_buckets([p.grad for p in params], self.group)  # a few calls, not one per parameter

    def _unit(self, s: _Session, unit: _Unit, ids: torch.Tensor | None, coef: tuple | None = None):
        """Run one unit: forward on its owner (and its backward for a grad unit), served elsewhere."""
        s.unit, s.next_layer = unit, 0
        layers = len(s.attn_layers)
        scale = self._scale()
        if unit.owner != s.rank:
            serve(s, scale, self.device)
            s.unit = None
            return []
        ids = ids.to(self.device).unsqueeze(0)
        pos = unit.positions(self.device)
        prompt_block = unit.start < s.bounds[-1]
        cache = s.carry.enter(unit.start, prompt_block, unit.grad)  # None: no state layers
        with torch.set_grad_enabled(unit.grad):
            hidden = self.adapter.hidden(ids, pos, cache)  # [1, n, hidden]
        if s.next_layer != layers:
            raise RuntimeError(f"{self.adapter.name} ran {s.next_layer} attention calls, expected {layers}")
        recorded, s.recorded = s.recorded, {}
        result = []
        if prompt_block:  # its keys/values into this rank's shard
            a = s.round.offsets[s.rank] if s.round is not None else unit.start - s.bounds[s.rank]
            b = a + unit.length
            if not unit.grad:
                for layer, (k, v) in recorded.items():
                    s.keys[layer][:, :, a:b] = k.detach()
                    s.values[layer][:, :, a:b] = v.detach()
                if unit.end == s.bounds[-1]:
                    s.last_hidden = hidden[0, -1].detach().contiguous()
                s.carry.leave(cache)
            else:
                outputs, grads = [hidden], [torch.zeros_like(hidden)]  # every layer's backward runs
                for layer, (k, v) in recorded.items():
                    outputs += [k, v]
                    grads += [s.key_grads[layer][:, :, a:b].clone(), s.value_grads[layer][:, :, a:b].clone()]
                outs, seeds = s.carry.backward_pairs(cache)  # the state it leaves: the later block's gradient
                torch.autograd.backward(outputs + outs, grads + seeds)
                s.carry.backward_done()
        else:  # a response: its log-probs and their gradient
            if unit.start == s.bounds[-1] - 1 or self.prompt_grad == "exact":  # the unit's first row predicts
                rows, targets = hidden[0, :-1], ids[0, 1:]
            else:  # truncated: the prompt's last row (a constant) does; only the head learns from it
                rows, targets = torch.cat([s.last_hidden[None].to(hidden.dtype), hidden[0, :-1]]), ids[0]
            with torch.set_grad_enabled(unit.grad):
                logits = self.adapter.logits(rows, self.temperature)
                wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
                logp = torch.log_softmax(logits.to(wide), -1)
                lp = logp.gather(-1, targets[:, None])[:, 0]  # [R]
                ent = -(logp.exp() * logp).sum(-1) if coef[1] is not None else None  # [R]
            if unit.grad:
                outs = [(t, c) for t, c in ((lp, coef[0]), (ent, coef[2])) if c is not None]
                torch.autograd.backward([t for t, _ in outs], [c.to(t.dtype).to(t.device) for t, c in outs])
            result.append((lp.detach(), ent.detach() if ent is not None else None))
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
        layout = rounds(cached, world, self.block_size) if self.schedule == "parallel" else []
        if layout:  # shard sizes: each rank's pieces; responses see every shard whole either way
            sizes = [sum(rd.length(r) for rd in layout) for r in range(world)]
            bounds = [0]
            for size in sizes:
                bounds.append(bounds[-1] + size)
        else:
            bounds = chunk_bounds(cached, world)
        n = bounds[rank + 1] - bounds[rank]
        dtype = attention.compute_dtype(self.device, self.adapter.head.weight.dtype)
        kinds = self.adapter.layer_kinds
        attn_layers = [i for i, kind in enumerate(kinds) if kind in ATTENTION_KINDS]

        def new() -> list[torch.Tensor]:  # state layers: an empty shard
            shape = lambda i: (1, self.kv_heads, n if i in attn_layers else 0, self.head_dim)  # noqa: E731
            return [torch.zeros(shape(i), dtype=dtype, device=self.device) for i in range(len(kinds))]

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
            attn_layers=attn_layers,
            carry=StateCarry(self.adapter.base.config, kinds, self.group, group_ranks, exact, self.device),
            layout=layout,
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
            ssm = compat.out_of_place_ssm_step(self.adapter.ssm_modules)  # Mamba-2 one-token steps
            with self.adapter.checkpointing_off(), self.adapter.attention_implementation(CP_ATTENTION), ssm:
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
