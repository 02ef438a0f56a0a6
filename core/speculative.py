"""Self-speculative rollout: batched speculative sampling with a quantized copy of the policy.

A :class:`~forkrl.core.quant.Drafter` (the policy, weight-quantized) proposes ``k`` tokens per
sequence; the policy scores all of them in one forward; speculative rejection sampling (Leviathan
et al., 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al., 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling") keeps a prefix of them so
that the output distribution is exactly the policy's. :class:`SpeculationPolicy` decides, step by
step, whether speculating pays on this machine for the current number of active sequences, and
how many tokens to draft.

Batching. Every sequence accepts its own number of tokens. Both models keep a key/value cache of
fixed capacity in which row ``b`` holds its tokens in columns ``0 .. len_b - 1`` (the prompt, left-
padded as given, then the completion); a forward writes row ``b``'s new tokens at its own column
``len_b`` and attends through a 4D mask, with explicit position ids. Rolling a row back is
therefore free: its length goes down and the stale columns are overwritten later. Finished rows
(EOS or ``max_new_tokens``) leave the batch and both caches at the end of the step.

Cache invariants between steps (``s`` = the row's tokens so far): the policy's cache holds all of
``s`` but its last token; the drafter's holds all of ``s`` but its last ``lag`` tokens, where
``lag`` is the same for every row (2 after a speculative step, one more after each plain step,
and the drafter is only prefilled when speculation first turns on).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.utils.logging import tqdm

from .quant import Drafter, _unwrap

logger = logging.getLogger(__name__)

__all__ = [
    "CostModel",
    "Decision",
    "Drafter",
    "SpeculationPolicy",
    "SpeculativeOutput",
    "SpeculativeSampler",
    "SpeculativeStats",
    "expected_tokens",
    "predicted_speedup",
    "speculative_accept",
    "warp_logits",
]

DEFAULT_LADDER = (1, 2, 3, 4, 6, 8)


# ----------------------------------------------------------------------------- distributions


def warp_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Temperature, then top-k, then top-p, with the semantics of Hugging Face's logits warpers.

    Mirrors ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (with
    ``min_tokens_to_keep=1``) in the order ``generate`` applies them; ties at the k-th value are
    kept, and the top-p cut keeps the smallest set whose mass exceeds ``top_p``.

    Args:
        logits: ``[N, V]`` float logits (float32, as ``generate`` casts them).
        temperature: > 0; 1.0 is a no-op.
        top_k: keep the k largest (None or 0: off).
        top_p: nucleus mass in (0, 1] (None or 1.0: off).

    Returns:
        ``[N, V]`` warped logits, filtered entries set to ``-inf``.
    """
    scores = logits
    if temperature != 1.0:
        scores = scores / temperature
    if top_k:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cum <= (1 - top_p)
        sorted_remove[..., -1:] = False
        remove = sorted_remove.scatter(-1, sorted_idx, sorted_remove)
        scores = scores.masked_fill(remove, -math.inf)
    return scores


def speculative_accept(
    drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling over a batch (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

    For each row, draft token ``x_j`` (sampled from ``q_j``) is accepted with probability
    ``min(1, p_j(x_j) / q_j(x_j))``, left to right, until the first rejection. At a rejection at
    ``j`` the row's next token is drawn from the residual ``norm(max(0, p_j - q_j))``; if all ``k``
    drafts are accepted, a bonus token is drawn from ``p_{k+1}``. Each emitted token then has
    exactly the distribution ``p`` given its prefix, whatever ``q`` is.

    Args:
        drafts: ``[B, k]`` draft tokens, ``drafts[:, j] ~ q[:, j]``.
        q: ``[B, k, V]`` drafter probabilities the drafts were sampled from (warped, normalised).
        p: ``[B, k + 1, V]`` target probabilities at the same positions plus one (warped, normalised).
        generator: random source.

    Returns:
        ``(n_accepted [B], next_token [B])``: the row keeps ``drafts[:, :n]`` then ``next_token``.
    """
    bsz, k = drafts.shape
    p_x = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # [B, k]
    q_x = q.gather(-1, drafts[..., None])[..., 0]  # [B, k], > 0: x was sampled from q
    u = torch.rand(bsz, k, generator=generator, device=drafts.device, dtype=p.dtype)
    # u < p/q  <=>  u * q < p (no division; p(x) = 0 never accepts, p(x) >= q(x) always does).
    accept = u * q_x < p_x
    n = accept.to(torch.int64).cumprod(-1).sum(-1)  # [B] leading accepts
    rows = torch.arange(bsz, device=drafts.device)
    p_n = p[rows, n]  # [B, V]: p at the first rejected position, or p_{k+1} when all accepted
    q_n = q[rows, n.clamp(max=k - 1)]
    residual = (p_n - q_n).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # When everything was accepted, or p == q up to rounding (the residual vanishes), draw from p.
    use_p = (n == k)[:, None] | (mass <= 0)
    dist = torch.where(use_p, p_n, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny))
    next_token = torch.multinomial(dist, 1, generator=generator)[:, 0]
    return n, next_token


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: keep drafts while they equal the target's argmax.

    Args:
        drafts: ``[B, k]`` drafter argmax tokens.
        target_logits: ``[B, k + 1, V]`` float32 target logits at the draft positions plus one.

    Returns:
        ``(n_accepted [B], next_token [B])`` with next_token the target's argmax after the kept drafts.
    """
    best = target_logits.argmax(-1)  # [B, k + 1], first maximum on ties, as generate
    k = drafts.shape[1]
    n = (drafts == best[:, :k]).to(torch.int64).cumprod(-1).sum(-1)
    return n, best.gather(1, n[:, None])[:, 0]


# ----------------------------------------------------------------------------- cost model


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per speculative step, ``(1 - alpha^(k+1)) / (1 - alpha)``.

    With i.i.d. per-token acceptance ``alpha`` a step emits the accepted prefix of the ``k``
    drafts plus one token from the target (correction or bonus) (Leviathan et al. 2023, eq. 1).
    """
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(
    alpha: float, k: int, t_plain: float, t_verify: float, t_draft_first: float, t_draft: float
) -> float:
    """Tokens per second of a speculative step relative to plain decoding.

    ``speedup = expected_tokens(alpha, k) * t_plain / (t_draft_first + (k - 1) * t_draft + t_verify)``

    Args:
        alpha: per-token acceptance probability.
        k: draft length (>= 1).
        t_plain: seconds of one plain decode step (target forward of one token per row, sampling).
        t_verify: seconds of the target forward over ``k + 1`` tokens per row (and their warping).
        t_draft_first: seconds of the step's first drafter call (two tokens per row: the drafter
            catches up on the previous step's last two tokens).
        t_draft: seconds of each further drafter call (one token per row, warping and sampling).
    """
    cost = t_draft_first + (k - 1) * t_draft + t_verify
    return expected_tokens(alpha, k) * t_plain / cost


def _monotone(table: dict[int, list[float]]) -> dict[int, list[float]]:
    """Running maxima along batch sizes, then along tokens per row: timings that only grow."""
    out = {n: list(itertools.accumulate(ts, max)) for n, ts in sorted(table.items())}
    ns = sorted(out)
    for a, b in itertools.pairwise(ns):
        out[b] = [max(x, y) for x, y in zip(out[a], out[b], strict=True)]
    return out


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear in x; linear extrapolation from the two nearest grid points outside."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0])
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-12)


@dataclass
class CostModel:
    """Measured forward times over a grid of active batch sizes: a pure function of numbers.

    Attributes:
        batch_sizes: ascending grid of active batch sizes.
        target_s: tokens-per-row ``n`` -> seconds of a target forward (with warping) at each batch size.
            Needs ``n = 1`` and ``n = k + 1`` for the draft lengths to be considered.
        draft_s: ``n`` -> seconds of a drafter call (with warping and sampling) per batch size; needs
            ``n = 1``, and ``n = 2`` (a step's first call); larger ``n`` time the catch-up after plain steps.
        context_len: the cached context the timings were taken at.
    """

    batch_sizes: list[int]
    target_s: dict[int, list[float]]
    draft_s: dict[int, list[float]]
    context_len: int = 0

    def __post_init__(self) -> None:
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or not self.batch_sizes:
            raise ValueError(f"batch_sizes must be ascending and distinct, got {self.batch_sizes}")
        for name, table, need in (("target_s", self.target_s, 1), ("draft_s", self.draft_s, 1)):
            if need not in table:
                raise ValueError(f"{name} needs timings for n={need} tokens per row")
            for n, ts in table.items():
                if len(ts) != len(self.batch_sizes):
                    raise ValueError(
                        f"{name}[{n}] has {len(ts)} timings for {len(self.batch_sizes)} batch sizes"
                    )
        self.target_s = {int(n): [float(t) for t in ts] for n, ts in self.target_s.items()}
        self.draft_s = {int(n): [float(t) for t in ts] for n, ts in self.draft_s.items()}
        self._memo: dict[tuple[int, int, int], float] = {}

    def _time(self, table: dict[int, list[float]], batch: int, n: int) -> float:
        key = (id(table), batch, n)
        if key not in self._memo:  # decide() runs every decode step: interpolate once per point
            ns = sorted(table)
            at_b = [_interp(self.batch_sizes, table[m], batch) for m in ns]
            self._memo[key] = at_b[0] if len(ns) == 1 else _interp(ns, at_b, n)
        return self._memo[key]

    def target(self, batch: int, n: int) -> float:
        """Seconds of a target forward over ``n`` tokens per row for ``batch`` rows."""
        return self._time(self.target_s, batch, n)

    def draft(self, batch: int, n: int) -> float:
        """Seconds of a drafter call over ``n`` tokens per row for ``batch`` rows."""
        return self._time(self.draft_s, batch, n)

    def speedup(self, batch: int, k: int, alpha: float) -> float:
        """:func:`predicted_speedup` for ``batch`` active rows and draft length ``k``."""
        return predicted_speedup(
            alpha,
            k,
            self.target(batch, 1),
            self.target(batch, k + 1),
            self.draft(batch, 2),
            self.draft(batch, 1),
        )

    def table(self, alpha: float, ladder: Sequence[int] = DEFAULT_LADDER) -> list[dict[str, float]]:
        """One row per grid batch size: times (ms), drafter/target time ratio, best k and its speedup."""
        rows = []
        for b in self.batch_sizes:
            gains = {k: self.speedup(b, k, alpha) for k in ladder}
            best = max(gains, key=gains.get)
            rows.append(
                {
                    "batch": b,
                    "target_ms": 1e3 * self.target(b, 1),
                    "verify_ms": 1e3 * self.target(b, best + 1),
                    "draft_ms": 1e3 * self.draft(b, 1),
                    "draft_over_target": self.draft(b, 1) / self.target(b, 1),
                    "verify_over_target": self.target(b, best + 1) / self.target(b, 1),
                    "best_k": best,
                    "speedup": gains[best],
                }
            )
        return rows


@dataclass
class Decision:
    """What the policy chose for one decode step (``k == 0``: plain decoding)."""

    k: int
    speedup: float
    alpha: float
    batch: int


class SpeculationPolicy:
    """Decides per decode step whether to speculate, and the draft length.

    Modes: ``auto`` (a :class:`CostModel`: speculate with the ``k`` from ``ladder`` that maximises
    the predicted speedup, only when it exceeds ``1 + margin``), ``fixed`` (always ``k``) and
    ``never`` (plain decoding). The acceptance rate is a running estimate (an exponential moving
    average of each speculative step's per-token acceptance), kept across ``generate`` calls.

    Choosing ``k`` from past acceptance does not bias the output: every speculative step is exact
    for any ``k`` fixed before its drafts are drawn.

    Args:
        cost_model: timings for ``auto`` mode (None for fixed/never).
        ladder: draft lengths to choose from.
        margin: speculate only when the predicted speedup exceeds ``1 + margin``.
        alpha_init: acceptance estimate before any speculative step.
        ema: weight of the newest step in the acceptance estimate.
        fixed_k: draft length in ``fixed`` mode; 0 means ``never``.
        horizon_fraction: share of the remaining token budget expected to be generated, when
            weighing the saving of turning speculation on against the drafter's catch-up.
    """

    def __init__(
        self,
        cost_model: CostModel | None = None,
        ladder: Sequence[int] = DEFAULT_LADDER,
        margin: float = 0.1,
        alpha_init: float = 0.8,
        ema: float = 0.2,
        fixed_k: int | None = None,
        horizon_fraction: float = 0.5,
    ) -> None:
        if cost_model is None and fixed_k is None:
            raise ValueError(
                "SpeculationPolicy needs a cost model (SpeculationPolicy.calibrate / from_timings) or a "
                "fixed draft length (SpeculationPolicy.fixed(k), SpeculationPolicy.never())"
            )
        if not ladder or any(int(k) < 1 for k in ladder):
            raise ValueError(f"ladder must be non-empty draft lengths >= 1, got {ladder}")
        if not 0.0 <= alpha_init <= 1.0 or not 0.0 < ema <= 1.0:
            raise ValueError(f"alpha_init must be in [0, 1] and ema in (0, 1], got {alpha_init}, {ema}")
        if fixed_k is not None and fixed_k < 0:
            raise ValueError(f"fixed_k must be >= 0, got {fixed_k}")
        self.cost_model = cost_model
        self.ladder = tuple(sorted(int(k) for k in ladder))
        self.margin = margin
        self.alpha = alpha_init
        self.ema = ema
        self.fixed_k = fixed_k
        self.horizon_fraction = horizon_fraction

    @property
    def mode(self) -> str:
        """The policy's mode: "auto", "fixed" or "never"."""
        if self.fixed_k is None:
            return "auto"
        return "fixed" if self.fixed_k > 0 else "never"

    @property
    def max_draft(self) -> int:
        """The longest draft this policy may ask for."""
        return self.fixed_k if self.fixed_k is not None else max(self.ladder)

    @classmethod
    def fixed(cls, k: int = 4) -> SpeculationPolicy:
        """Always speculate with draft length ``k``."""
        if k < 1:
            raise ValueError(
                f"fixed draft length must be >= 1, got {k}; use SpeculationPolicy.never() for plain"
            )
        return cls(fixed_k=k, ladder=(k,))

    @classmethod
    def never(cls) -> SpeculationPolicy:
        """Plain decoding (the sampler's own baseline)."""
        return cls(fixed_k=0)

    @classmethod
    def from_timings(
        cls,
        batch_sizes: Sequence[int],
        target_s: dict[int, Sequence[float]],
        draft_s: dict[int, Sequence[float]],
        context_len: int = 0,
        **kwargs,
    ) -> SpeculationPolicy:
        """An ``auto`` policy from timings measured elsewhere (another engine, a saved calibration).

        Args:
            batch_sizes: ascending grid of active batch sizes.
            target_s: tokens per row -> seconds of a target forward per batch size (n = 1 and k + 1).
            draft_s: tokens per row (1, 2, and optionally more for catch-ups) -> seconds of a drafter
                call per batch size.
            context_len: the context length the timings were taken at.
            **kwargs: ``ladder``, ``margin``, ``alpha_init``, ``ema``.
        """
        cm = CostModel(
            list(batch_sizes),
            {n: list(v) for n, v in target_s.items()},
            {n: list(v) for n, v in draft_s.items()},
            context_len,
        )
        return cls(cost_model=cm, **kwargs)

    @classmethod
    @torch.no_grad()
    def calibrate(
        cls,
        model: nn.Module,
        drafter: Drafter,
        batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
        context_len: int = 256,
        repeats: int = 5,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        progress: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        **kwargs,
    ) -> SpeculationPolicy:
        """Time the target and the drafter on this machine and return an ``auto`` policy.

        Each grid point runs the sampler's own forward (ragged cache with rows at different
        lengths, 4D mask, warping and sampling) over a cache of about ``context_len`` columns,
        ``repeats`` times after one warm-up, and keeps the fastest (other load only adds time);
        the table is then made non-decreasing in batch size and in tokens per row, since
        measurement noise can invert neighbouring points. The cache contents do not matter for
        timing, so nothing is prefilled.

        Args:
            model: the target model.
            drafter: its drafter.
            batch_sizes: active batch sizes to time.
            context_len: cached context during the timed forwards.
            repeats: timed repetitions per point.
            temperature, top_k, top_p: the sampling settings whose warping cost to include.
            progress: show a progress bar.
            clock: seconds counter (``time.process_time`` measures CPU time, which on a shared
                machine with one torch thread ignores other processes' load).
            **kwargs: ``ladder``, ``margin``, ``alpha_init``, ``ema``.
        """
        ladder = tuple(kwargs.get("ladder", DEFAULT_LADDER))
        ns_target = sorted({1} | {k + 1 for k in ladder})
        sampling = _Sampling(temperature > 0, temperature or 1.0, top_k, top_p, None)
        target = _Runner(model, cache_capacity=context_len + max(ns_target))
        draft = _Runner(drafter.model, cache_capacity=context_len + 16)
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
            batch = _Batch.fake(b, context_len + n, vocab, device)
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
                _sync(device)
                t0 = clock()
                call()
                _sync(device)
                samples.append(clock() - t0)
            times[(which, b, n)] = min(samples)  # interference only ever adds time
        cm = CostModel(
            list(batch_sizes),
            _monotone({n: [times[("target", b, n)] for b in batch_sizes] for n in ns_target}),
            _monotone({n: [times[("draft", b, n)] for b in batch_sizes] for n in ns_draft}),
            context_len,
        )
        return cls(cost_model=cm, **kwargs)

    def decide(
        self, batch_size: int, max_k: int | None = None, lag: int = 2, horizon: int | None = None
    ) -> Decision:
        """Draft length for the next step (0: plain).

        Turning speculation on has a one-off cost: the drafter must first process the tokens it
        skipped while off (``lag`` of them per row). It turns on only when the predicted speedup
        exceeds ``1 + margin`` *and* the time it saves over ``horizon_fraction`` of the remaining
        token budget pays for that catch-up; once on (``lag <= 2``) it stays on while the speedup
        exceeds ``1 + margin / 2`` (hysteresis: no flapping around the threshold).

        Args:
            batch_size: active sequences.
            max_k: the longest useful draft this step (the largest remaining token budget minus one).
            lag: tokens per row the drafter has not processed (2 while speculating).
            horizon: the largest remaining token budget of the active rows (None: unbounded).
        """
        cap = self.max_draft if max_k is None else min(self.max_draft, max_k)
        if self.mode != "auto" or cap < 1:
            k = min(self.fixed_k or 0, max(cap, 0))
            return Decision(k, float("nan"), self.alpha, batch_size)
        cm = self.cost_model
        best_k, best = 0, -math.inf
        for k in self.ladder:
            if k > cap:
                break
            s = cm.speedup(batch_size, k, self.alpha)
            if s > best:
                best_k, best = k, s
        on = lag <= 2
        if best <= 1.0 + (self.margin / 2 if on else self.margin):
            return Decision(0, best, self.alpha, batch_size)
        if not on and horizon is not None:
            # Time saved per token = t_plain * (1 - 1 / speedup); the catch-up costs the drafter's
            # forward over `lag` tokens minus the two it processes on every speculative step anyway.
            saved = cm.target(batch_size, 1) * (1 - 1 / best) * horizon * self.horizon_fraction
            if saved <= cm.draft(batch_size, lag) - cm.draft(batch_size, 2):
                return Decision(0, best, self.alpha, batch_size)
        return Decision(best_k, best, self.alpha, batch_size)

    def observe(self, accepted: int, rejected: int) -> None:
        """Update the acceptance estimate after a speculative step.

        Args:
            accepted: draft tokens accepted over all rows.
            rejected: rows that stopped at a rejection (rows that accepted every draft saw none).
        """
        if accepted + rejected == 0:
            return
        # Per-token acceptance of a geometric run censored at k: successes / (successes + failures).
        step_alpha = accepted / (accepted + rejected)
        self.alpha = (1 - self.ema) * self.alpha + self.ema * step_alpha


# ----------------------------------------------------------------------------- results


@dataclass
class SpeculativeStats:
    """Figures of one ``generate`` call (detached Python numbers, ready for a metrics dict).

    Attributes:
        proposed: draft tokens proposed, over rows and steps.
        accepted: draft tokens accepted.
        acceptance_rate: accepted / proposed (nan without speculation).
        mean_accepted_length: mean tokens emitted per row per speculative step (accepted drafts + 1).
        draft_length_history: k of every decode step after the prefill (0 = plain step).
        batch_size_history: active rows at every decode step.
        speculated_fraction: fraction of decode steps that speculated.
        target_calls: target forwards (including the prefill).
        drafter_calls: drafter forwards.
        wall_time_s: seconds in ``generate``.
        generated_tokens: completion tokens returned (sum of completion_lengths).
        decisions: the policy's choice at every decode step (k, predicted speedup, alpha, batch).
        kernel: the drafter's kernel path ("int4-native", "int8-native", "...-dequant" or "none").
        policy_mode: "auto", "fixed" or "never".
        final_alpha: the policy's acceptance estimate at the end.
    """

    proposed: int = 0
    accepted: int = 0
    acceptance_rate: float = float("nan")
    mean_accepted_length: float = float("nan")
    draft_length_history: list[int] = field(default_factory=list)
    batch_size_history: list[int] = field(default_factory=list)
    speculated_fraction: float = 0.0
    target_calls: int = 0
    drafter_calls: int = 0
    wall_time_s: float = 0.0
    generated_tokens: int = 0
    decisions: list[Decision] = field(default_factory=list)
    kernel: str = "none"
    policy_mode: str = "never"
    final_alpha: float = float("nan")
    _spec_row_steps: int = 0

    def as_metrics(self, prefix: str = "speculative/") -> dict[str, float]:
        """Scalar figures for a host's metrics dict."""
        keys = (
            "acceptance_rate",
            "mean_accepted_length",
            "speculated_fraction",
            "target_calls",
            "drafter_calls",
            "wall_time_s",
            "generated_tokens",
            "final_alpha",
        )
        out = {prefix + k: float(getattr(self, k)) for k in keys}
        hist = [k for k in self.draft_length_history if k]
        out[prefix + "mean_draft_length"] = sum(hist) / len(hist) if hist else 0.0
        return out

    def to_dict(self) -> dict:
        """All fields as plain Python (decisions as dicts)."""
        d = asdict(self)
        d.pop("_spec_row_steps")
        return d


@dataclass
class SpeculativeOutput:
    """Result of :meth:`SpeculativeSampler.generate`.

    Attributes:
        sequences: ``[B, P + T]`` the prompt as given (left-padded) then the completion, right-
            padded with ``pad_token_id``; ``T`` is the longest completion (the layout of HF generate).
        completion_lengths: ``[B]`` completion tokens per row, including the EOS token if emitted.
        stats: figures of the call.
    """

    sequences: torch.Tensor
    completion_lengths: torch.Tensor
    stats: SpeculativeStats


# ----------------------------------------------------------------------------- ragged cache


class _RaggedState:
    """Where the current forward writes; shared by the cache layers of one model."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.write_pos: torch.Tensor | None = None  # [B] first column of this forward's tokens
        self.uniform: int | None = None  # the common write column when all rows agree
        self.kv_len = 0  # columns handed to attention (the longest row after this forward)


class _RaggedLayer(DynamicLayer):
    """Full-attention cache layer with a fixed capacity and a write column per row.

    ``keys``/``values`` are ``[B, kv_heads, capacity, head_dim]``; row ``b``'s new states go to
    columns ``write_pos[b] .. write_pos[b] + T - 1``; attention gets the first ``kv_len`` columns
    and the 4D mask hides what a row must not see. Buffers start zeroed so masked columns are finite.
    """

    def __init__(self, state: _RaggedState) -> None:
        super().__init__()
        self.state = state

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:  # noqa: D102
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros(b, h, self.state.capacity, d)
        self.values = value_states.new_zeros(
            b, value_states.shape[1], self.state.capacity, value_states.shape[-1]
        )
        self.is_initialized = True

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


class _RaggedCache(DynamicCache):
    """A DynamicCache whose layers are :class:`_RaggedLayer` sharing one write state."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.state = _RaggedState(capacity)
        Cache.__init__(self, layers=[_RaggedLayer(self.state) for _ in range(num_layers)])


def _check_full_attention(model: nn.Module, what: str) -> int:
    cfg = model.config.get_text_config(decoder=True)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        raise ValueError(
            f"the {what} uses attn_implementation={impl!r}; the speculative sampler passes a 4D mask over "
            "a ragged cache, which needs 'sdpa' or 'eager': load the model with attn_implementation='sdpa'"
        )
    layers = DynamicCache(config=cfg).layers
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise ValueError(
            f"the {what} has cache layers {kinds}; the speculative sampler supports full-attention decoder "
            "models only (no sliding-window, linear-attention or recurrent layers): use plain generation"
        )
    return len(layers)


class _Batch:
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
    def fake(cls, bsz: int, length: int, vocab: int, device: torch.device) -> _Batch:
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


class _Runner:
    """One model (target or drafter) forwarding new tokens of a ragged batch through its cache."""

    def __init__(self, model: nn.Module, cache_capacity: int, what: str = "model") -> None:
        self.model = model
        self.num_layers = _check_full_attention(model, what)
        self.capacity = cache_capacity
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.has_keep = "logits_to_keep" in params
        emb = model.get_input_embeddings().weight
        self.device, self.dtype = emb.device, emb.dtype
        self.sdpa = model.config._attn_implementation == "sdpa"
        self.calls = 0
        self.cache = _RaggedCache(self.num_layers, cache_capacity)

    def reset(self) -> None:
        self.cache = _RaggedCache(self.num_layers, self.capacity)

    def select(self, keep: torch.Tensor) -> None:
        for layer in self.cache.layers:
            layer.batch_select_indices(keep)

    def forward(self, batch: _Batch, write_pos: torch.Tensor, t: int, keep: int) -> torch.Tensor:
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
class _Sampling:
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


# ----------------------------------------------------------------------------- sampler


class SpeculativeSampler:
    """Batched generation from ``model``, speculating with ``drafter`` where ``policy`` says it pays.

    Sampling is exact: the sequences have the distribution of plain sampling from ``model`` with
    the same temperature/top-k/top-p, and greedy decoding returns the tokens of
    ``model.generate(do_sample=False)`` (up to floating-point ties of the argmax).

    Args:
        model: a Hugging Face causal LM with full attention ('sdpa' or 'eager'), possibly wrapped
            (DDP / DeepSpeed ``.module``); its ``generation_config`` supplies EOS and pad ids.
        drafter: its :class:`Drafter` (None only with ``SpeculationPolicy.never()``).
        policy: when and how far to speculate; default ``SpeculationPolicy.fixed(4)``.
    """

    def __init__(
        self, model: nn.Module, drafter: Drafter | None, policy: SpeculationPolicy | None = None
    ) -> None:
        self.model = _unwrap(model)
        self.generation_config = getattr(self.model, "generation_config", None)
        self.policy = policy or (
            SpeculationPolicy.fixed(4) if drafter is not None else SpeculationPolicy.never()
        )
        if drafter is None and self.policy.mode != "never":
            raise ValueError(
                "a drafter is needed to speculate: pass Drafter.from_policy(model), or SpeculationPolicy.never()"
            )
        self.drafter = drafter
        _check_full_attention(self.model, "model")
        if drafter is not None:
            self._check_drafter(drafter)

    def _check_drafter(self, drafter: Drafter) -> None:
        v_model = self.model.config.get_text_config().vocab_size
        v_draft = drafter.config.get_text_config().vocab_size
        if v_model != v_draft:
            raise ValueError(
                f"the drafter has vocab_size={v_draft} but the model {v_model}: build it with Drafter.from_policy(model)"
            )
        if not drafter.matches(self.model):
            raise ValueError(
                "the drafter was built from a model with different parameter names/shapes (another architecture); "
                "build it with Drafter.from_policy(model) from this model"
            )

    def _special_ids(self, eos_token_id, pad_token_id) -> tuple[list[int], int]:
        gc = self.generation_config
        if eos_token_id is None and gc is not None:
            eos_token_id = gc.eos_token_id
        eos = (
            []
            if eos_token_id is None
            else [eos_token_id]
            if isinstance(eos_token_id, int)
            else list(eos_token_id)
        )
        if pad_token_id is None and gc is not None:
            pad_token_id = gc.pad_token_id
        if pad_token_id is None:
            pad_token_id = eos[0] if eos else 0
        return [int(e) for e in eos], int(pad_token_id)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        do_sample: bool | None = None,
    ) -> SpeculativeOutput:
        """Sample completions for a batch of prompts.

        Args:
            input_ids: ``[B, P]`` prompts, left-padded.
            attention_mask: ``[B, P]`` 1 for prompt tokens, 0 for padding (default all ones).
            max_new_tokens: completion budget per row (>= 1).
            temperature: sampling temperature; 0 means greedy.
            top_k: keep the k most likely tokens (None/0: off), applied after temperature.
            top_p: nucleus mass (None/1.0: off), applied after top-k.
            eos_token_id: id or ids that end a completion; None takes the model's generation
                config; ``[]`` disables EOS.
            pad_token_id: fills the completion after its end; None takes the generation config,
                else the first EOS id, else 0.
            generator: random source (seeded runs are deterministic).
            do_sample: False forces greedy (as in HF generate); None samples unless temperature == 0.

        Returns:
            :class:`SpeculativeOutput` with ``sequences [B, P + T]``, ``completion_lengths [B]``, ``stats``.
        """
        t_start = time.perf_counter()
        input_ids, attention_mask = self._check_inputs(input_ids, attention_mask, max_new_tokens)
        if temperature < 0 or (top_k is not None and top_k < 0) or (top_p is not None and not 0 < top_p <= 1):
            raise ValueError(
                f"temperature={temperature}, top_k={top_k}, top_p={top_p}: need temperature >= 0, top_k >= 0 "
                "(0/None: off) and top_p in (0, 1] (None/1.0: off)"
            )
        greedy = do_sample is False or temperature == 0
        sampling = _Sampling(greedy, temperature if temperature > 0 else 1.0, top_k, top_p, generator)
        eos, pad = self._special_ids(eos_token_id, pad_token_id)
        eos_t = torch.tensor(eos, dtype=torch.long, device=input_ids.device)
        policy = self.policy
        bsz, plen = input_ids.shape
        spec_on = self.drafter is not None and policy.mode != "never"
        capacity = plen + max_new_tokens + (policy.max_draft if spec_on else 0)
        stats = SpeculativeStats(
            kernel=self.drafter.kernel if self.drafter is not None else "none", policy_mode=policy.mode
        )
        batch = _Batch(input_ids, attention_mask, capacity)
        target = _Runner(self.model, capacity, "model")
        draft = _Runner(self.drafter.model, capacity, "drafter") if spec_on else None
        completions = torch.full((bsz, max_new_tokens), pad, dtype=torch.long, device=input_ids.device)
        lengths = torch.zeros(bsz, dtype=torch.long, device=input_ids.device)
        limit = plen + max_new_tokens

        def settle(old_len: torch.Tensor, n_new: torch.Tensor) -> None:
            """Advance rows by n_new tokens, cut at the first EOS and the budget, retire finished rows."""
            span = int(n_new.max())
            cols = (old_len[:, None] + torch.arange(span, device=old_len.device)).clamp(max=capacity - 1)
            in_step = torch.arange(span, device=old_len.device) < n_new[:, None]
            is_eos = torch.isin(batch.tokens.gather(1, cols), eos_t) & in_step
            has_eos = is_eos.any(-1)
            new_len = torch.where(has_eos, old_len + is_eos.to(torch.int8).argmax(-1) + 1, old_len + n_new)
            new_len = new_len.clamp(max=limit)
            batch.seq_len = new_len
            done = has_eos | (new_len >= limit)
            if bool(done.any()):
                idx = done.nonzero()[:, 0]
                n = new_len[idx] - plen
                seg = batch.tokens[idx, plen:limit]  # [D, max_new_tokens]
                seg = torch.where(torch.arange(max_new_tokens, device=seg.device) < n[:, None], seg, pad)
                completions[batch.rows[idx]] = seg
                lengths[batch.rows[idx]] = n
                keep = (~done).nonzero()[:, 0]
                batch.select(keep)
                target.select(keep)
                if draft is not None:
                    draft.select(keep)

        # Prefill: the whole prompt through the target; its last logits give the first token.
        logits = target.forward(batch, torch.zeros(bsz, dtype=torch.long, device=input_ids.device), plen, 1)
        batch.put(batch.seq_len, sampling.next_token(logits[:, -1]))
        old = batch.seq_len
        settle(old, torch.ones_like(old))
        lag = plen + 1  # the drafter has seen nothing yet

        while batch.size:
            remaining = int((limit - batch.seq_len).max())
            decision = (
                policy.decide(batch.size, max_k=remaining - 1, lag=lag, horizon=remaining)
                if spec_on
                else Decision(0, float("nan"), float("nan"), batch.size)
            )
            k = decision.k
            stats.decisions.append(decision)
            stats.draft_length_history.append(k)
            stats.batch_size_history.append(batch.size)
            seq_len = batch.seq_len
            if k == 0:
                # Plain step: the pending token through the target, one new token from p.
                logits = target.forward(batch, seq_len - 1, 1, 1)[:, -1]
                batch.put(seq_len, sampling.next_token(logits))
                lag += 1
                settle(seq_len, torch.ones_like(seq_len))
                continue
            n, nxt = self._speculate(batch, target, draft, sampling, k, lag)
            lag = 2
            batch.put(seq_len + n, nxt)
            accepted = int(n.sum())
            stats.proposed += k * batch.size
            stats.accepted += accepted
            stats._spec_row_steps += batch.size
            policy.observe(accepted, int((n < k).sum()))
            settle(seq_len, n + 1)

        steps = len(stats.draft_length_history)
        if stats.proposed:
            stats.acceptance_rate = stats.accepted / stats.proposed
            stats.mean_accepted_length = (stats.accepted + stats._spec_row_steps) / stats._spec_row_steps
        stats.speculated_fraction = sum(1 for k in stats.draft_length_history if k) / steps if steps else 0.0
        stats.target_calls, stats.drafter_calls = target.calls, draft.calls if draft is not None else 0
        stats.generated_tokens = int(lengths.sum())
        stats.final_alpha = policy.alpha
        width = int(lengths.max())
        sequences = torch.cat([input_ids, completions[:, :width]], 1)
        stats.wall_time_s = time.perf_counter() - t_start
        return SpeculativeOutput(sequences, lengths, stats)

    def _speculate(
        self, batch: _Batch, target: _Runner, draft: _Runner, sampling: _Sampling, k: int, lag: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One speculative step: k drafts per row, one verifying target forward, acceptance.

        Returns:
            ``(n_accepted [B], next_token [B])``; drafts are already in ``batch.tokens`` at
            columns ``seq_len .. seq_len + k - 1``.
        """
        seq_len = batch.seq_len
        drafts, qs = [], []
        # The drafter first catches up on the last `lag` tokens, then feeds its own drafts.
        logits = draft.forward(batch, seq_len - lag, lag, 1)[:, -1]
        for j in range(k):
            if j:
                logits = draft.forward(batch, seq_len + j - 1, 1, 1)[:, -1]
            if sampling.greedy:
                d = logits.argmax(-1)
            else:
                q = sampling.probs(logits)  # [B, V]
                d = sampling.draw(q)
                qs.append(q)
            batch.put(seq_len + j, d)
            drafts.append(d)
        drafts = torch.stack(drafts, 1)  # [B, k]
        # Verify: the pending token and the k drafts in one target forward -> p at k + 1 positions.
        t_logits = target.forward(batch, seq_len - 1, k + 1, 0)  # [B, k + 1, V]
        if sampling.greedy:
            return greedy_accept(drafts, t_logits)
        p = sampling.probs(t_logits.reshape(-1, t_logits.shape[-1])).reshape(t_logits.shape)
        return self._accept(drafts, torch.stack(qs, 1), p, sampling.generator)

    def _accept(
        self, drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Acceptance rule (overridable for negative-control tests): :func:`speculative_accept`."""
        return speculative_accept(drafts, q, p, generator)

    def _check_inputs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be a [batch, prompt_len] tensor, got {getattr(input_ids, 'shape', type(input_ids))}: "
                "left-pad the prompts into one 2D tensor"
            )
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(
                f"empty prompt batch {tuple(input_ids.shape)}: every row needs at least one prompt token"
            )
        if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
        if int(max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        device = self.model.get_input_embeddings().weight.device
        input_ids = input_ids.to(device=device, dtype=torch.long)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}: "
                "pass the mask of the same padded batch"
            )
        attention_mask = attention_mask.to(device)
        empty = (attention_mask.sum(-1) == 0).nonzero()[:, 0].tolist()
        if empty:
            raise ValueError(
                f"rows {empty} of attention_mask are all padding: every prompt needs at least one token"
            )
        vocab = self.model.config.get_text_config().vocab_size
        if int(input_ids.max()) >= vocab or int(input_ids.min()) < 0:
            raise ValueError(
                f"input_ids hold ids outside [0, {vocab}): check the tokenizer matches the model"
            )
        return input_ids, attention_mask


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
