"""When to speculate and how far: the cost model and the policy.

Speculating pays when the tokens a step emits, ``expected_tokens(alpha, k)``, outweigh the
step's cost relative to plain decoding (the drafter's ``k`` forwards plus one verifying target
forward over ``k + 1`` tokens). :class:`CostModel` holds forward times measured on the machine
over a grid of active batch sizes; :class:`SpeculationPolicy` turns speculation on only where
the predicted speedup exceeds ``1 + margin`` and moves the draft length along a ladder as the
measured acceptance rate changes.
"""

from __future__ import annotations

import itertools
import math
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..quant import Drafter
from .ragged import time_forwards

__all__ = [
    "DEFAULT_LADDER",
    "CostModel",
    "Decision",
    "SpeculationPolicy",
    "expected_tokens",
    "predicted_speedup",
]

DEFAULT_LADDER = (1, 2, 3, 4, 6, 8)


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
        target_s, draft_s = time_forwards(
            model,
            drafter,
            batch_sizes,
            context_len,
            repeats,
            temperature,
            top_k,
            top_p,
            progress,
            clock,
            ladder,
        )
        # Noise can invert neighbouring points: timings are made non-decreasing in both axes.
        cm = CostModel(list(batch_sizes), _monotone(target_s), _monotone(draft_s), context_len)
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

    def batch_schedule(self, max_batch: int) -> list[tuple[int, int, int]]:
        """The draft length per active batch size, as inclusive ranges ``(first, last, k)``, 1..``max_batch``.

        What :meth:`decide` would pick with no length limit at the current acceptance estimate
        (``k = 0``: plain decoding), for engines that take a fixed table when they start (vLLM's
        ``num_speculative_tokens_per_batch_size``) rather than asking every step.
        """
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        ks = [self.decide(b).k for b in range(1, max_batch + 1)]
        ranges: list[tuple[int, int, int]] = []
        for b, k in enumerate(ks, start=1):
            if ranges and ranges[-1][2] == k:
                ranges[-1] = (ranges[-1][0], b, k)
            else:
                ranges.append((b, b, k))
        return ranges

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
