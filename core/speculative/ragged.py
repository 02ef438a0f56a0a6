"""The ragged-batch forward the speculative sampler runs, and its timing for the cost model.

Both models (the policy and its drafter) keep a key/value cache of fixed capacity in which row
``b`` holds its tokens in columns ``0 .. len_b - 1``; a forward writes row ``b``'s new tokens at its
own column and attends through a 4D mask with explicit position ids (see :mod:`.hf` for the cache
invariants between steps). :func:`time_forwards` times these same forwards for
:meth:`.policy.SpeculationPolicy.calibrate`, so the cost model measures what the sampler runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils.logging import tqdm

from .. import compat
from ..quant import Drafter
from .accept import warp_logits

__all__ = ["Batch", "RaggedCache", "Runner", "Sampling", "check_full_attention", "time_forwards"]


class RaggedState:
    """Where the current forward writes; shared by the cache layers of one model."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.write_pos: torch.Tensor | None = None  # [B] first column of this forward's tokens
        self.uniform: int | None = None  # the common write column when all rows agree
        self.kv_len = 0  # columns handed to attention (the longest row after this forward)


class RaggedLayer(compat.DynamicLayer):
    """Full-attention cache layer with a fixed capacity and a write column per row.

    ``keys``/``values`` are ``[B, kv_heads, capacity, head_dim]``; row ``b``'s new states go to
    columns ``write_pos[b] .. write_pos[b] + T - 1``; attention gets the first ``kv_len`` columns
    and the 4D mask hides what a row must not see. Buffers start zeroed so masked columns are finite.
    """

    def __init__(self, state: RaggedState) -> None:
        super().__init__()
        self.state = state

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:  # noqa: D102
        b, h, _, d = key_states.shape
        self.keys = key_states.new_zeros(b, h, self.state.capacity, d)
        self.values = value_states.new_zeros(
            b, value_states.shape[1], self.state.capacity, value_states.shape[-1]
        )
        compat.mark_initialized(self, key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):  # noqa: D102
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        st, t = self.state, key_states.shape[-2]
        if st.uniform is not None:
            self.keys[:, :, st.uniform : st.uniform + t] = key_states
            self.values[:, :, st.uniform : st.uniform + t] = value_states
        else:
            # Per-row columns through index_put on a [B, C, H, D] view (scatter_ is 20x slower for
            # bfloat16 on CPU in torch 2.13).
            cols = st.write_pos[:, None] + torch.arange(t, device=key_states.device)  # [B, T]
            rows = torch.arange(cols.shape[0], device=cols.device)[:, None]
            self.keys.transpose(1, 2)[rows, cols] = key_states.transpose(1, 2)
            self.values.transpose(1, 2)[rows, cols] = value_states.transpose(1, 2)
        return self.keys[:, :, : st.kv_len], self.values[:, :, : st.kv_len]

    def get_seq_length(self) -> int:  # noqa: D102
        return self.state.kv_len

    def batch_select_indices(self, indices: torch.Tensor) -> None:  # noqa: D102
        if self.is_initialized:
            self.keys = self.keys[indices]
            self.values = self.values[indices]


class RaggedCache(compat.DynamicCache):
    """A DynamicCache whose layers are :class:`RaggedLayer` sharing one write state."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.state = RaggedState(capacity)
        compat.init_cache(self, [RaggedLayer(self.state) for _ in range(num_layers)])


def check_full_attention(model: nn.Module, what: str) -> int:
    cfg = model.config.get_text_config(decoder=True)
    impl = compat.attention_implementation(model.config)
    if impl not in ("sdpa", "eager"):
        raise ValueError(
            f"the {what} uses attn_implementation={impl!r}; the speculative sampler passes a 4D mask over "
            "a ragged cache, which needs 'sdpa' or 'eager': load the model with attn_implementation='sdpa'"
        )
    layers = compat.DynamicCache(config=cfg).layers
    if not layers or any(type(layer) is not compat.DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise ValueError(
            f"the {what} has cache layers {kinds}; the speculative sampler supports full-attention decoder "
            "models only (no sliding-window, linear-attention or recurrent layers): use plain generation"
        )
    return len(layers)


class Batch:
    """Tokens and per-row bookkeeping of the active rows, in the cache's column layout."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int) -> None:
        bsz, plen = input_ids.shape
        dev = input_ids.device
        self.prompt_len = plen
        self.size = bsz
        self.tokens = torch.zeros(bsz, capacity, dtype=torch.long, device=dev)
        self.tokens[:, :plen] = input_ids
        mask = attention_mask.to(torch.long)
        # Position ids as generate forms them: valid tokens count 0, 1, ...; pads read position 1.
        prompt_pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        gen_pos = mask.sum(-1, keepdim=True) + torch.arange(capacity - plen, device=dev)
        self.pos = torch.cat([prompt_pos, gen_pos], 1)
        self.valid = torch.ones(bsz, capacity, dtype=torch.bool, device=dev)
        self.valid[:, :plen] = mask.bool()
        self.seq_len = torch.full((bsz,), plen, dtype=torch.long, device=dev)
        self.rows = torch.arange(bsz, device=dev)  # original row of each active row

    @classmethod
    def fake(cls, bsz: int, length: int, vocab: int, device: torch.device) -> Batch:
        """Random tokens, all valid: for timing."""
        ids = torch.randint(0, vocab, (bsz, 1), device=device)
        b = cls(ids, torch.ones_like(ids), length)
        b.tokens.random_(0, vocab)
        return b

    def put(self, cols: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values[b]`` at column ``cols[b]`` of each row (``[B]`` each)."""
        self.tokens.scatter_(1, cols[:, None], values[:, None])

    def select(self, keep: torch.Tensor) -> None:
        for name in ("tokens", "pos", "valid", "seq_len", "rows"):
            setattr(self, name, getattr(self, name)[keep])
        self.size = int(keep.numel())


class Runner:
    """One model (target or drafter) forwarding new tokens of a ragged batch through its cache."""

    def __init__(self, model: nn.Module, cache_capacity: int, what: str = "model") -> None:
        self.model = model
        self.num_layers = check_full_attention(model, what)
        self.capacity = cache_capacity
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.has_keep = "logits_to_keep" in params
        emb = model.get_input_embeddings().weight
        self.device, self.dtype = emb.device, emb.dtype
        self.sdpa = compat.attention_implementation(model.config) == "sdpa"
        self.calls = 0
        self.cache = RaggedCache(self.num_layers, cache_capacity)

    def reset(self) -> None:
        self.cache = RaggedCache(self.num_layers, self.capacity)

    def select(self, keep: torch.Tensor) -> None:
        for layer in self.cache.layers:
            layer.batch_select_indices(keep)

    def forward(self, batch: Batch, write_pos: torch.Tensor, t: int, keep: int) -> torch.Tensor:
        """Forward ``t`` new tokens per row, row ``b``'s at columns ``write_pos[b] ..``.

        Returns:
            float32 logits ``[B, keep or t, V]`` of the last ``keep`` new positions (0: all).
        """
        cols = write_pos[:, None] + torch.arange(t, device=write_pos.device)  # [B, t]
        ids = batch.tokens.gather(1, cols)
        pos = batch.pos.gather(1, cols)
        first = int(write_pos[0])
        uniform = bool((write_pos == first).all())
        kv_len = (first if uniform else int(write_pos.max())) + t
        key_cols = torch.arange(kv_len, device=write_pos.device)
        # Row b's query at column c sees valid columns <= c; a pad query sees only itself, so no
        # attention row is empty (an empty row would put NaN into the pad's states).
        allow = (key_cols <= cols[..., None]) & batch.valid[:, None, :kv_len]
        allow |= key_cols == cols[..., None]
        if self.sdpa:
            mask = allow[:, None]
        else:  # eager adds the mask
            mask = torch.zeros(allow.shape, dtype=self.dtype, device=allow.device)[:, None]
            mask.masked_fill_(~allow[:, None], torch.finfo(self.dtype).min)
        st = self.cache.state
        st.write_pos, st.uniform, st.kv_len = write_pos, first if uniform else None, kv_len
        kwargs = {self.cache_kw: self.cache, "use_cache": True}
        if self.has_keep:
            kwargs["logits_to_keep"] = keep
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **kwargs).logits
        if not self.cache.layers[0].is_initialized:
            raise RuntimeError(
                "the model did not write its key/value cache (gradient checkpointing drops the cache in training "
                "mode): generate under model.eval() or with gradient checkpointing disabled"
            )
        self.calls += 1
        if keep and logits.shape[1] != keep:
            logits = logits[:, -keep:]
        return logits.float()


@dataclass
class Sampling:
    greedy: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[N, V]`` float32 logits -> warped, normalised probabilities."""
        return warp_logits(logits, self.temperature, self.top_k, self.top_p).softmax(-1)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]

    def next_token(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` logits -> ``[B]`` tokens (argmax when greedy)."""
        return logits.argmax(-1) if self.greedy else self.draw(self.probs(logits))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_forwards(
    model: nn.Module,
    drafter: Drafter,
    batch_sizes: Sequence[int],
    context_len: int,
    repeats: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    progress: bool,
    clock: Callable[[], float],
    ladder: Sequence[int],
) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """The sampler's own forwards timed over a grid (see :meth:`.policy.SpeculationPolicy.calibrate`).

    Returns:
        ``(target_s, draft_s)``: tokens per row -> the fastest seconds of one forward per batch
        size in ``batch_sizes``, for the target and the drafter (raw: the policy smooths them).
    """
    ns_target = sorted({1} | {k + 1 for k in ladder})
    sampling = Sampling(temperature > 0, temperature or 1.0, top_k, top_p, None)
    target = Runner(model, cache_capacity=context_len + max(ns_target))
    draft = Runner(drafter.model, cache_capacity=context_len + 16)
    device = target.device
    # Drafter: one token (drafting), two (the first call of a step), 16 (the slope of a catch-up).
    ns_draft = (1, 2, 16)
    jobs = [(b, "target", n) for b in batch_sizes for n in ns_target] + [
        (b, "draft", n) for b in batch_sizes for n in ns_draft
    ]
    times: dict[tuple[str, int, int], float] = {}
    vocab = model.config.get_text_config().vocab_size
    for b, which, n in tqdm(jobs, desc="calibrating speculation", disable=not progress):
        runner = target if which == "target" else draft
        batch = Batch.fake(b, context_len + n, vocab, device)
        # Ragged rows (as after any speculative step): the per-row write path is timed.
        write = context_len - (torch.arange(b, device=device) % 2)
        runner.reset()
        keep = 0 if which == "target" else 1

        def call(runner=runner, batch=batch, write=write, n=n, keep=keep, which=which) -> None:
            logits = runner.forward(batch, write, n, keep)
            probs = sampling.probs(logits.reshape(-1, logits.shape[-1]))
            if which == "draft":
                sampling.draw(probs)

        call()
        samples = []
        for _ in range(repeats):
            sync(device)
            t0 = clock()
            call()
            sync(device)
            samples.append(clock() - t0)
        times[(which, b, n)] = min(samples)  # interference only ever adds time
    target_s = {n: [times[("target", b, n)] for b in batch_sizes] for n in ns_target}
    draft_s = {n: [times[("draft", b, n)] for b in batch_sizes] for n in ns_draft}
    return target_s, draft_s
