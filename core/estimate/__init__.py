"""What switching tree training on would save, before switching it on (``python -m forkrl estimate``).

From a user's prompts (or logged rollouts) and their model: the forest's compression, the
predicted step speedup and autograd memory of each tree mode against the stock path, and the mode
``tree_mode="auto"`` would pick, with the reason. :mod:`.workload` reads the data into optimizer
steps; :mod:`.pricing` prices a shape (fitted to timings of the model on this machine, or from its
config's FLOPs).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from ..balance.plan import forest_stats
from ..train.options import TreeOptions
from .pricing import TREE_MODES, Pricing, config_flops, config_pricing, fit_pricing
from .workload import Workload, dense_stats, load_rows, read_workload, tree_peaks

__all__ = [
    "Estimate",
    "ModeEstimate",
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


@dataclass
class ModeEstimate:
    """One path's predicted cost over the workload: training seconds (for ``fitted`` pricing;
    FLOPs otherwise), the step speedup over stock (training alone, and with the host's scoring
    passes), and the peak saved bytes (plus, for replay, the key/value cache it holds)."""

    mode: str
    train_cost: float
    train_speedup: float
    step_speedup: float
    saved_bytes: float
    cache_bytes: float = 0.0


@dataclass
class Estimate:
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
    stock: ModeEstimate
    modes: dict[str, ModeEstimate]
    refused: dict[str, str]
    pick: str
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


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
    """Price ``workload``'s steps on every path with ``pricing`` and pick the mode as
    ``tree_mode="auto"`` would (``options``: the user's other tree options)."""
    options = options or TreeOptions(tree_packing=True)
    block = options.replay_block_size
    dense = tree = 0.0
    dense_score = tree_score = 0.0
    per_mode = dict.fromkeys(pricing.train, 0.0)
    peak = {name: 0.0 for name in per_mode}
    flops = config_pricing(config)
    for step in workload.steps:
        stats, dense_peak = dense_stats(step, micro_batch_tokens)
        tstats, peaks = forest_stats(step.forest), tree_peaks(step, leaf_batch_tokens, block)
        dense += flops.train["dense"].predict(stats)
        tree += flops.train["keep"].predict(tstats)
        dense_score += pricing.score["dense"].predict(stats)
        tree_score += pricing.score["tree"].predict(tstats)
        for name, model in pricing.train.items():
            per_mode[name] += model.predict(stats if name == "dense" else tstats)
            held = dense_peak if name == "dense" else peaks[name]
            per_token, per_scored = pricing.saved_bytes.get(name, (0.0, 0.0))
            peak[name] = max(peak[name], per_token * held[0] + per_scored * held[1])
    longest = workload.longest_path()

    def mode(name: str) -> ModeEstimate:
        step_stock = per_mode["dense"] + score_passes * dense_score
        step_tree = per_mode[name] + score_passes * tree_score
        cache = pricing.cache_bytes_per_token * longest if name == "replay" else 0.0
        return ModeEstimate(
            name,
            per_mode[name],
            per_mode["dense"] / per_mode[name],
            step_stock / step_tree,
            peak[name],
            cache,
        )

    pick, reason = _pick(options, longest, gradient_checkpointing)
    return Estimate(
        prompts=workload.prompts,
        steps=len(workload.steps),
        group_size=workload.group_size,
        logged=workload.logged,
        prompt_tokens_median=statistics.median(workload.prompt_lengths()),
        completion_tokens_median=statistics.median(workload.completion_lengths()),
        compression=workload.compression(),
        ideal_flop_ratio=dense / tree,
        score_passes=score_passes,
        pricing=pricing.how,
        stock=mode("dense"),
        modes={name: mode(name) for name in TREE_MODES if name in per_mode},
        refused=dict(pricing.refused),
        pick=pick,
        reason=reason,
    )


def _pick(options: TreeOptions, longest: int, gradient_checkpointing: bool) -> tuple[str, str]:
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


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def format_report(est: Estimate) -> str:
    """The estimate as a few lines and a table, for a terminal."""
    source = "logged rollouts" if est.logged else f"G={est.group_size} completions of the full length each"
    lines = [
        f"workload: {est.prompts} prompts in {est.steps} optimizer steps, {source}; median prompt "
        f"{est.prompt_tokens_median:.0f} tokens, median completion {est.completion_tokens_median:.0f}",
        f"forest: {est.compression:.2f}x fewer tokens than the same rows as independent sequences; ideal FLOP ratio "
        f"{est.ideal_flop_ratio:.2f}x",
        f"pricing: {est.pricing}; each step also scores {est.score_passes} no-grad pass(es) (old/reference log-probs)",
        "",
        f"{'path':<8} {'train speedup':>14} {'step speedup':>13} {'saved for backward':>19} {'kv cache held':>14}",
    ]
    for m in (est.stock, *est.modes.values()):
        name = "stock" if m.mode == "dense" else m.mode
        cache = _mib(m.cache_bytes) if m.cache_bytes else "-"
        lines.append(
            f"{name:<8} {m.train_speedup:>13.2f}x {m.step_speedup:>12.2f}x {_mib(m.saved_bytes):>19} {cache:>14}"
        )
    for mode, why in est.refused.items():
        lines.append(f"{mode:<8} refused: {why}")
    lines += ["", f"tree_mode=auto picks {est.pick}: {est.reason}"]
    return "\n".join(lines)
