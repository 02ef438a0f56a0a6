"""What switching tree training on would save, before switching it on (``python -m forkrl estimate``).

From a user's prompts (or logged rollouts) and their model: the forest's compression, the
predicted step speedup (with its spread over repeated timings) and autograd memory of each tree
mode against the stock path, and what to run: the mode ``tree_mode="auto"`` would pick, with the
reason, or stock (tree_packing off) when no tree mode is predicted faster, with a warning.
:mod:`.workload` reads the data into optimizer steps; :mod:`.pricing` prices a shape (fitted to
timings of the model on this machine, or from its config's FLOPs).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from ..balance.plan import forest_stats
from ..train.options import TreeOptions
from .pricing import TREE_MODES, PathCosts, Pricing, config_flops, config_pricing, fit_pricing
from .workload import Workload, dense_stats, load_rows, read_workload, tree_peaks

__all__ = [
    "MIN_GAIN",
    "Estimate",
    "ModeEstimate",
    "PathCosts",
    "Pricing",
    "Workload",
    "config_flops",
    "config_pricing",
    "estimate",
    "fit_pricing",
    "format_report",
    "load_rows",
    "read_workload",
]


# The predicted step speedup below which the estimate says to leave tree_packing off: a smaller gain
# is within what the prices' own error can hide (their fit to timings, a device's other kernels).
MIN_GAIN = 1.05


@dataclass
class ModeEstimate:
    """One path's predicted cost over the workload and its speedup over stock.

    Every speedup is the stock path's predicted cost over this path's, both from the same cost
    models: the stock path's own is 1.0 exactly. The ranges are the lowest and highest speedup
    predicted by the cost models fitted to each repeat's timings alone (equal to the speedup when
    the pricing has no repeats); the estimate itself comes from the fit to each shape's fastest repeat,
    which can lie outside that range.

    Attributes:
        mode: ``"dense"`` (stock) or a tree mode.
        train_cost: training cost over the workload (seconds for fitted pricing, FLOPs otherwise).
        train_speedup: stock's training cost over this path's.
        step_speedup: the same with the host's no-grad scoring passes added to both.
        train_speedup_range: ``(lowest, highest)`` over the repeats.
        step_speedup_range: ``(lowest, highest)`` over the repeats.
        saved_bytes: autograd's saved bytes at the path's peak.
        cache_bytes: the key/value cache replay holds without autograd.
    """

    mode: str
    train_cost: float
    train_speedup: float
    step_speedup: float
    train_speedup_range: tuple[float, float]
    step_speedup_range: tuple[float, float]
    saved_bytes: float
    cache_bytes: float = 0.0


@dataclass
class Estimate:
    """The estimate of one workload (:func:`estimate`).

    ``pick`` is what to run (a mode other than ``auto_mode`` where the model refuses auto's): ``"stock"``
    (tree_packing off) when no tree mode is predicted at least
    :data:`MIN_GAIN` times as fast as stock, else the mode ``tree_mode="auto"`` runs (``auto_mode``), with ``reason``.
    ``warnings`` has a line for every tree mode predicted slower than stock and for a pick whose
    speedup is within the timings' spread of 1.
    """

    prompts: int
    steps: int
    group_size: int
    logged: bool
    prompt_tokens_median: float
    completion_tokens_median: float
    compression: float
    ideal_flop_ratio: float
    score_passes: int
    pricing: str
    timing_spread: dict[str, float]
    stock: ModeEstimate
    modes: dict[str, ModeEstimate]
    refused: dict[str, str]
    auto_mode: str
    pick: str
    reason: str
    warnings: list[str]

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Totals:
    """A workload's summed predicted costs under one :class:`PathCosts`."""

    train: dict[str, float]
    score_dense: float
    score_tree: float

    def speedups(self, mode: str, score_passes: int) -> tuple[float, float]:
        """(training, step) speedup of ``mode`` over stock; for ``"dense"`` both are x / x = 1.0."""
        stock_step = self.train["dense"] + score_passes * self.score_dense
        score = self.score_dense if mode == "dense" else self.score_tree
        step = self.train[mode] + score_passes * score
        return _ratio(self.train["dense"], self.train[mode]), _ratio(stock_step, step)


def _ratio(stock: float, other: float) -> float:
    if stock == other:
        return 1.0
    return stock / other if other > 0 else float("inf")


def estimate(
    workload: Workload,
    pricing: Pricing,
    config,
    micro_batch_tokens: int,
    score_passes: int = 0,
    gradient_checkpointing: bool = False,
    options: TreeOptions | None = None,
    leaf_batch_tokens: int = 1 << 13,
) -> Estimate:
    """Price ``workload``'s steps on every path with ``pricing`` and pick what to run: the mode
    ``tree_mode="auto"`` would run (``options``: the user's other tree options), or stock when no
    tree mode is predicted faster.

    Raises:
        ValueError: ``score_passes`` without scoring costs in ``pricing``.
    """
    options = options or TreeOptions(tree_packing=True)
    if score_passes and not {"dense", "tree"} <= set(pricing.costs.score):
        raise ValueError(
            f"score_passes={score_passes}, but the pricing has no scoring costs: fit it with score=True"
        )
    block = options.replay_block_size
    shapes = []
    peak = dict.fromkeys(pricing.costs.train, 0.0)
    flops = config_pricing(config).costs.train
    dense_flops = tree_flops = 0.0
    for step in workload.steps:
        stats, dense_peak = dense_stats(step, micro_batch_tokens)
        tstats, peaks = forest_stats(step.forest), tree_peaks(step, leaf_batch_tokens, block)
        shapes.append((stats, tstats))
        dense_flops += flops["dense"].predict(stats)
        tree_flops += flops["keep"].predict(tstats)
        for name in peak:
            held = dense_peak if name == "dense" else peaks[name]
            per_token, per_scored = pricing.saved_bytes.get(name, (0.0, 0.0))
            peak[name] = max(peak[name], per_token * held[0] + per_scored * held[1])

    def totals(costs: PathCosts) -> _Totals:
        return _Totals(
            train={
                name: sum(model.predict(d if name == "dense" else t) for d, t in shapes)
                for name, model in costs.train.items()
            },
            score_dense=sum(costs.score["dense"].predict(d) for d, _ in shapes) if score_passes else 0.0,
            score_tree=sum(costs.score["tree"].predict(t) for _, t in shapes) if score_passes else 0.0,
        )

    point = totals(pricing.costs)
    repeats = [totals(c) for c in pricing.repeats] or [point]
    longest = workload.longest_path()

    def mode(name: str) -> ModeEstimate:
        train, step = point.speedups(name, score_passes)
        each = [r.speedups(name, score_passes) for r in repeats]
        return ModeEstimate(
            mode=name,
            train_cost=point.train[name],
            train_speedup=train,
            step_speedup=step,
            train_speedup_range=(min(e[0] for e in each), max(e[0] for e in each)),
            step_speedup_range=(min(e[1] for e in each), max(e[1] for e in each)),
            saved_bytes=peak[name],
            cache_bytes=pricing.cache_bytes_per_token * longest if name == "replay" else 0.0,
        )

    modes = {name: mode(name) for name in TREE_MODES if name in point.train}
    auto, reason = _auto(options, longest, gradient_checkpointing)
    pick, reason, warnings = _pick(auto, reason, modes, pricing.refused)
    return Estimate(
        prompts=workload.prompts,
        steps=len(workload.steps),
        group_size=workload.group_size,
        logged=workload.logged,
        prompt_tokens_median=statistics.median(workload.prompt_lengths()),
        completion_tokens_median=statistics.median(workload.completion_lengths()),
        compression=workload.compression(),
        ideal_flop_ratio=dense_flops / tree_flops,
        score_passes=score_passes,
        pricing=pricing.how,
        timing_spread=dict(pricing.timing_spread),
        stock=mode("dense"),
        modes=modes,
        refused=dict(pricing.refused),
        auto_mode=auto,
        pick=pick,
        reason=reason,
        warnings=warnings,
    )


def _auto(options: TreeOptions, longest: int, gradient_checkpointing: bool) -> tuple[str, str]:
    """The mode ``tree_mode="auto"`` runs on this workload, and why."""
    mode = options.mode_for(longest, gradient_checkpointing)
    if options.tree_mode != "auto" or options.long_context_replay:
        return mode, "set by the options"
    if gradient_checkpointing:
        return mode, (
            "the host's gradient checkpointing is on, so auto replays (recomputes nodes) instead of keeping "
            "their activations; set tree_mode=keep to trade that memory for keep's speed"
        )
    if mode == "replay":
        return (
            mode,
            f"the longest path ({longest} tokens) exceeds tree_replay_threshold={options.replay_threshold}",
        )
    return mode, (
        f"every path fits under tree_replay_threshold={options.replay_threshold} tokens (the longest has {longest}), "
        "so auto keeps each node's activations and computes every shared token once"
    )


def _pick(
    auto: str, reason: str, modes: dict[str, ModeEstimate], refused: dict[str, str]
) -> tuple[str, str, list[str]]:
    """Stock when no tree mode's predicted step speedup reaches :data:`MIN_GAIN`, else auto's mode (the
    fastest mode, to be set by name, where the model refuses auto's); a warning for each mode predicted
    slower than stock and for a pick within the spread of 1."""
    warnings = [
        f"warning: tree_mode={name} is predicted slower than stock on this workload: {_step(m)} per step"
        for name, m in modes.items()
        if m.step_speedup < 1.0
    ]
    best = max(modes.values(), key=lambda m: m.step_speedup)
    if best.step_speedup <= 1.0:
        warnings.append(
            f"warning: no tree mode is predicted faster than stock (the best, {best.mode}, {_step(best)} per "
            "step): leave tree_packing off"
        )
        why = f"no tree mode is predicted faster than stock, so tree_packing stays off (tree_mode=auto would run {auto})"
        return "stock", why, warnings
    if best.step_speedup < MIN_GAIN:
        why = (
            f"the best tree mode, {best.mode}, is predicted {_step(best)} per step, under the {MIN_GAIN:.2f}x a "
            f"tree must gain to be switched on, so tree_packing stays off (tree_mode=auto would run {auto})"
        )
        return "stock", why, warnings
    if auto not in modes:  # the model refuses the mode auto would run: it would fail at the first step
        warnings.append(
            f"warning: tree_mode=auto would run {auto} here, which this model refuses: {refused.get(auto)}"
        )
        why = f"set tree_mode={best.mode} ({_step(best)} per step): tree_mode=auto would run {auto}, which this model refuses"
        return best.mode, why, warnings
    chosen = modes[auto]
    if chosen.step_speedup < 1.0:
        warnings.append(
            f"warning: tree_mode=auto runs {auto}, predicted slower than stock; set tree_mode={best.mode} "
            f"({_step(best)} per step) or leave tree_packing off"
        )
    elif chosen.step_speedup - _margin(chosen.step_speedup, chosen.step_speedup_range) <= 1.0:
        warnings.append(
            f"warning: {auto}'s predicted speedup, {_step(chosen)} per step, is within the timings' spread of 1: "
            "it may be no faster than stock"
        )
    return auto, reason, warnings


def _step(m: ModeEstimate) -> str:
    return _with_range(m.step_speedup, m.step_speedup_range)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def _margin(value: float, span: tuple[float, float]) -> float:
    """How far the farthest repeat's prediction lies from the estimate (0 without repeats)."""
    return max(span[1] - value, value - span[0], 0.0)


def _with_range(value: float, span: tuple[float, float]) -> str:
    """``2.31x ±0.08``: the estimate, and the farthest any repeat's own prediction lies from it."""
    margin = _margin(value, span)
    return f"{value:.2f}x ±{margin:.2f}" if margin > 0 else f"{value:.2f}x"


def format_report(est: Estimate) -> str:
    """The estimate as a few lines and a table, for a terminal."""
    source = "logged rollouts" if est.logged else f"G={est.group_size} completions of the full length each"
    pricing = est.pricing
    if est.timing_spread:
        worst = max(est.timing_spread, key=est.timing_spread.__getitem__)
        spread = est.timing_spread[worst]
        pricing += f" (a shape's repeated timings differ by {spread:.0%} of their median at most: {worst})"
    lines = [
        f"workload: {est.prompts} prompts in {est.steps} optimizer steps, {source}; median prompt "
        f"{est.prompt_tokens_median:.0f} tokens, median completion {est.completion_tokens_median:.0f}",
        f"forest: {est.compression:.2f}x fewer tokens than the same rows as independent sequences; ideal FLOP ratio "
        f"{est.ideal_flop_ratio:.2f}x",
        f"pricing: {pricing}; each step also scores {est.score_passes} no-grad pass(es) (old/reference log-probs)",
    ]
    if est.timing_spread:
        lines.append("±: the farthest from the estimate that a fit to one repeat's timings alone predicts")
    lines += [
        "",
        f"{'path':<8} {'train speedup':>14} {'step speedup':>14} {'saved for backward':>19} {'kv cache held':>14}",
    ]
    for m in (est.stock, *est.modes.values()):
        name = "stock" if m.mode == "dense" else m.mode
        cache = _mib(m.cache_bytes) if m.cache_bytes else "-"
        train = _with_range(m.train_speedup, m.train_speedup_range)
        step = _with_range(m.step_speedup, m.step_speedup_range)
        lines.append(f"{name:<8} {train:>14} {step:>14} {_mib(m.saved_bytes):>19} {cache:>14}")
    for mode, why in est.refused.items():
        lines.append(f"{mode:<8} refused: {why}")
    lines += ["", *est.warnings]
    if est.pick == "stock":
        lines.append(f"pick: stock (tree_packing off): {est.reason}")
    else:
        lines.append(
            f"tree_mode=auto picks {est.pick}: {est.reason}"
            if est.pick == est.auto_mode
            else f"pick: tree_mode={est.pick}: {est.reason}"
        )
    return "\n".join(lines)
