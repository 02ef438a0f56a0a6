"""What each path costs, per shape: fitted on the spot from timings of the user's model, or priced
from its config's FLOPs when the model is too large to time here.

A source of prices returns a :class:`Pricing`: one cost model per path (the estimate), and
optionally the same models fitted to each of several repeated measurements (the estimate's
spread). :func:`fit_pricing` and :func:`config_pricing` are the two sources; a source that has no
repeated measurements leaves ``repeats`` empty and its estimate has no spread.

Fitting builds the model from its config (random weights: a step's time does not depend on them),
times the stock path and each tree mode on six batches cut from one of the workload's own steps
(:func:`calibration_steps`: its groups, what they share and its completions, with one or two of
its sizes halved), and fits one :class:`~forkrl.core.balance.CostModel` per path (seconds as a
non-negative linear function of tokens, attended pairs, units and scored rows). Cut from the step,
the batches have its mix of units, tokens and scored rows, so the fit interpolates to the step
(lone groups cut from a step of many groups sharing a document left the units of the tree 8 times
outside what was timed, and identical estimates differed by 1.7x).

A shared machine makes timings unreliable, and one way dominates: timed with as many threads as
cores, every parallel operation waits for its slowest thread, and while another process holds a
core that thread waits for a time slice. The stall is paid per operation, not per FLOP, so it
grows calls many times over (on a 2-core machine under other processes' load, a stock step took
about 4 times as long on two threads as on one) and tilts the comparison against the paths with
more, smaller operations (the tree modes). The fit therefore times on one thread (``threads``)
and counts that thread's CPU time, which leaves out the time another process held the core.
Beyond that, every shape is first run untimed (its allocations and first-use work), each timed
sample runs the call until it lasts ``min_seconds`` (short calls are mostly timer and scheduler
jitter), the paths of a shape are timed back to back in every repeat (load that changes over the
fit hits stock and tree alike), Python's garbage collector is off inside a timed call, and the fit
takes each point's fastest repeat, since a fit of four coefficients to six points amplifies whatever
noise its points carry when it extrapolates, and on one thread's CPU time the noise only adds
(another process sharing the cache, the memory bus or the core's other hyperthread): the fastest
sample is the closest to the work itself. The prediction is for the thread count timed: the tree's
speedup on one thread is not its speedup on many. The steps priced later are the workload's own: the
fit never times them.
Autograd's saved bytes are measured on the same batches, per held token and per scored row.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..balance.cost import CostModel, PieceStats
from ..balance.plan import forest_stats
from ..compat import set_checkpointing
from ..errors import UnsupportedModelError
from ..executor import TreeExecutor
from ..memory import SavedBytes
from .workload import Step, dense_stats, micro_batches, tree_peaks

__all__ = [
    "TREE_MODES",
    "PathCosts",
    "Pricing",
    "CALIBRATION_BOUNDS",
    "calibration_coefs",
    "calibration_steps",
    "config_pricing",
    "dense_step",
    "fit_pricing",
    "grpo_batch",
]

TREE_MODES = ("keep", "replay", "packed")


@dataclass
class PathCosts:
    """Cost models of one pricing: per path (``"dense"`` and each tree mode) its training step, and
    per scoring kind (``"dense"``, ``"tree"``) its no-grad pass."""

    train: dict[str, CostModel]
    score: dict[str, CostModel]


@dataclass
class Pricing:
    """How a workload's steps are priced.

    Attributes:
        how: one line saying where the prices come from.
        costs: the cost models the estimate uses.
        repeats: the same cost models fitted to each repeated measurement alone (empty when the
            source has none): the estimate's spread is the spread of their predictions.
        timing_spread: per path, the largest (slowest - fastest) / median of one shape's repeated
            timings (empty without repeats).
        saved_bytes: per path, autograd's saved bytes per held token and per scored row.
        cache_bytes_per_token: key/value cache bytes per token (replay holds a path's cache
            without autograd).
        refused: tree modes the model refuses, with the reason.
    """

    how: str
    costs: PathCosts
    saved_bytes: dict[str, tuple[float, float]]
    cache_bytes_per_token: float
    repeats: list[PathCosts] = field(default_factory=list)
    timing_spread: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------- the plain path


def grpo_batch(P: int, G: int, R: int, vocab: int, seed: int = 0):
    """One GRPO group: a random P-token prompt, G random R-token completions and per-token
    coefficients (the gradient of ``sum(coef * logprob)`` stands in for a host's loss).

    Returns:
        ``(sequences, score_from, coefs)``: G ``[P + R]`` token tensors, ``[P] * G``, G ``[R]`` tensors.
    """
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (P,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(0, vocab, (R,), generator=g)]) for _ in range(G)]
    coefs = [torch.randn(R, generator=g) / (G * R) for _ in range(G)]
    return seqs, [P] * G, coefs


def dense_step(model: nn.Module, seqs, score_from, coefs, max_tokens: int, grad: bool) -> list[torch.Tensor]:
    """The plain path: the rows in the stock path's micro-batches of at most ``max_tokens`` padded
    tokens (:func:`~.workload.micro_batches`; prompts left-padded and completions right-padded to a
    micro-batch's longest, with an attention mask where any row is padded), logits only for the
    completion columns; with ``grad``, backward of ``sum(coef * logprob)``.

    Args:
        seqs: ``[P_i + R_i]`` token tensors.
        score_from: each row's prompt length ``P_i``.
        coefs: ``[R_i]`` coefficient tensors.

    Returns:
        Per micro-batch, its ``[rows, longest R]`` log-probs (detached; padded columns are log-probs
        of the pad token).
    """
    device = next(model.parameters()).device
    out = []
    lengths = [len(s) for s in seqs]
    for first, n, prompt_max, completion_max in micro_batches(score_from, lengths, max_tokens):
        rows = range(first, first + n)
        ids = torch.zeros(n, prompt_max + completion_max, dtype=torch.long)
        mask = torch.zeros_like(ids)
        weights = torch.zeros(n, completion_max, dtype=coefs[first].dtype)
        for j, i in enumerate(rows):
            start, end = prompt_max - score_from[i], prompt_max + lengths[i] - score_from[i]
            ids[j, start:end] = torch.as_tensor(seqs[i])
            mask[j, start:end] = 1
            weights[j, : end - prompt_max] = coefs[i]
        ids = ids.to(device)
        # Where a row is padded, the mask and positions counted from its first token, as hosts pass.
        padded = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
        with torch.set_grad_enabled(grad):
            logits = model(
                input_ids=ids,
                **({k: v.to(device) for k, v in padded.items()} if bool((mask == 0).any()) else {}),
                logits_to_keep=completion_max + 1,
                use_cache=False,
            ).logits[:, :-1]
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half: scored in float32
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, prompt_max:, None])[..., 0]
            if grad:
                (lp * weights.to(lp.device)).sum().backward()
        out.append(lp.detach())
    return out


# ---------------------------------------------------------------------------- fitting


#: Bounds of the step the calibration batches are cut from: tokens per prompt and completion,
#: completions per group, and the step's tokens as independent rows (groups past it are left out,
#: at least one kept). They keep a fit within about a minute on a CPU; larger steps are extrapolated.
CALIBRATION_BOUNDS = {"prompt": 2048, "completion": 512, "group": 16, "tokens": 16384}


def calibration_steps(step: Step, bounds: dict[str, int] | None = None) -> list[Step]:
    """Six batches cut from one of the workload's steps, so the fit sees its structure (groups of a
    step sharing a document, logged completions opening alike) and interpolates to it, instead of
    extrapolating from lone groups: the step, bounded by ``bounds`` (:data:`CALIBRATION_BOUNDS`),
    with one or two of its prompts, group sizes and completions halved. A prompt is halved by
    keeping every other token, which keeps what prompts share at their start shared; a group keeps
    its first completions and a completion its first tokens. None is the step itself, so the fit
    never times the shape it prices.
    """
    b = {**CALIBRATION_BOUNDS, **(bounds or {})}
    groups: list[tuple[list[int], list[list[int]]]] = []  # (prompt, completions), rows in order
    for seq, sf in zip(step.sequences, step.score_from, strict=True):
        prompt = list(seq[:sf])
        if not groups or groups[-1][0] != prompt:
            groups.append((prompt, []))
        groups[-1][1].append(list(seq[sf:]))
    groups = [(p[: b["prompt"]], [c[: b["completion"]] for c in cs[: b["group"]]]) for p, cs in groups]
    kept, tokens = [], 0
    for prompt, completions in groups:
        size = sum(len(prompt) + len(c) for c in completions)
        if kept and tokens + size > b["tokens"]:
            break
        kept.append((prompt, completions))
        tokens += size

    def cut(half_prompt: bool, half_group: bool, half_completion: bool) -> Step:
        seqs, sf = [], []
        for prompt, completions in kept:
            p = prompt[::2] if half_prompt and len(prompt) > 1 else prompt
            cs = completions[: max(1, len(completions) // 2)] if half_group else completions
            for c in cs:
                seqs.append(p + (c[: max(1, len(c) // 2)] if half_completion else c))
                sf.append(len(p))
        return Step(seqs, sf)

    halves = ((1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 0, 1), (0, 1, 1))
    return [cut(*map(bool, h)) for h in halves]


def calibration_coefs(step: Step, seed: int = 0) -> list[torch.Tensor]:
    """Random per-token coefficients of ``step``'s completions (``sum(coef * logprob)`` stands in for
    a host's loss): one ``[R_i]`` tensor per row."""
    g = torch.Generator().manual_seed(seed)
    rows = len(step.sequences)
    return [
        torch.randn(len(s) - sf, generator=g) / (rows * (len(s) - sf))
        for s, sf in zip(step.sequences, step.score_from, strict=True)
    ]


def _timed(
    model: nn.Module, fn: Callable[[], object], calls: int = 1, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Seconds per call of ``fn`` over ``calls`` calls by ``clock`` (gradients cleared before each, untimed).

    Python's garbage collector is off while a call runs, as in :mod:`timeit`: a full collection
    costs in proportion to every object the process holds (a test session's, a host's), not to the
    path timed, and one inside a small shape's sample made it several times its median.
    """
    total = 0.0
    collecting = gc.isenabled()
    for _ in range(calls):
        model.zero_grad(set_to_none=True)
        gc.disable()
        try:
            start = clock()
            fn()
            total += clock() - start
        finally:
            if collecting:
                gc.enable()
    return total / calls


def fit_pricing(
    model: nn.Module,
    steps: list[Step],
    micro_batch_tokens: int,
    block_size: int,
    leaf_batch_tokens: int,
    gradient_checkpointing: bool = False,
    repeats: int = 3,
    min_seconds: float = 0.05,
    threads: int | None = 1,
    score: bool = True,
    progress: Callable[[str], None] = lambda _: None,
) -> Pricing:
    """Time every path on ``steps`` ``repeats`` times and fit the models (module docstring).

    Args:
        model: the user's model, built from its config (weights do not matter).
        steps: the calibration batches (:func:`calibration_steps`; at least 4).
        micro_batch_tokens: the stock path's micro-batch bound in padded tokens.
        block_size: replay's block size.
        leaf_batch_tokens: the executors' leaf batch bound.
        gradient_checkpointing: time the stock path with the model's gradient checkpointing on.
        repeats: timed samples per shape and path (at least 2: the spread needs two).
        min_seconds: a sample repeats its call until it lasts at least this long.
        threads: torch's intra-op threads while timing (restored after); None keeps the current
            setting (on a machine nothing else uses, to price the speed of all its cores). On one
            thread a call's CPU time is timed, else its wall time.
        score: also time the no-grad scoring passes (``costs.score``; leave them out when the
            host scores nothing).
        progress: called with a line before each stage.

    Returns:
        A :class:`Pricing` fitted to each point's fastest repeat, with ``repeats`` (one
        fit per repeat) and ``timing_spread``; a tree mode the model refuses is in ``refused``.

    Raises:
        ValueError: fewer than 4 steps, ``repeats`` below 2, ``min_seconds`` negative or
            ``threads`` below 1.
    """
    if len(steps) < 4:
        raise ValueError(f"fit_pricing: {len(steps)} steps: a cost model has 4 coefficients to fit")
    if repeats < 2:
        raise ValueError(f"fit_pricing: repeats={repeats}: the spread needs at least 2 repeats")
    if not min_seconds >= 0:
        raise ValueError(f"fit_pricing: min_seconds={min_seconds} must be >= 0")
    if threads is not None and threads < 1:
        raise ValueError(f"fit_pricing: threads={threads} must be >= 1 (or None: torch's current setting)")
    vocab = model.config.vocab_size
    model.train()
    executors, refused = _executors(model, block_size, leaf_batch_tokens)

    def runs(k: int, step: Step) -> dict[str, _Run]:
        return _runs(
            model,
            executors,
            step,
            calibration_coefs(step, seed=k),
            micro_batch_tokens,
            block_size,
            leaf_batch_tokens,
            gradient_checkpointing,
            score,
        )

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    used = torch.get_num_threads()
    try:
        _warm_up(model, executors, vocab, micro_batch_tokens)
        # On one thread every operation runs on the calling thread: its CPU time is the work,
        # without the time other processes held the core.
        clock = time.thread_time if used == 1 else time.perf_counter
        timings = _measure(model, steps, runs, repeats, min_seconds, clock, progress)
    finally:
        torch.set_num_threads(before)
    return Pricing(
        how=f"fitted on this machine ({_processor()}) to {len(steps)} batches cut from a step, timed {repeats} times each on "
        f"{used} thread{'s' if used > 1 else ''}",
        costs=timings.costs(min),
        saved_bytes={name: _per_token(r) for name, r in timings.saved.items()},
        cache_bytes_per_token=_cache_bytes_per_token(model.config, next(model.parameters()).element_size()),
        repeats=[timings.costs(lambda t, rep=rep: t[rep]) for rep in range(repeats)],
        timing_spread={
            name: max((max(t) - min(t)) / statistics.median(t) for t in per_shape)
            for name, per_shape in timings.seconds.items()
        },
        refused=refused,
    )


#: One path on one calibration batch: its priced shape, the ``(tokens, scored)`` it holds at its
#: peak (None for a no-grad scoring pass) and the call to time.
_Run = tuple[PieceStats, "tuple[float, float] | None", Callable[[], object]]


@dataclass
class _Timings:
    """Per path, each calibration shape's :class:`PieceStats` and its repeated seconds; per grad
    path, (held shape, saved bytes) per shape."""

    stats: dict[str, list[PieceStats]]
    seconds: dict[str, list[list[float]]]
    saved: dict[str, list[tuple[PieceStats, float]]]

    def costs(self, pick: Callable[[list[float]], float]) -> PathCosts:
        """Cost models fitted to one figure per shape, ``pick`` of its repeated seconds."""
        fits = {
            name: CostModel.fit(self.stats[name], [pick(t) for t in self.seconds[name]])
            for name in self.seconds
        }
        return PathCosts(
            train={name: fit for name, fit in fits.items() if not name.startswith("score:")},
            score={
                name.removeprefix("score:"): fit for name, fit in fits.items() if name.startswith("score:")
            },
        )


def _measure(
    model: nn.Module,
    steps: list[Step],
    runs_of: Callable[[int, Step], dict[str, _Run]],
    repeats: int,
    min_seconds: float,
    clock: Callable[[], float],
    progress: Callable[[str], None],
) -> _Timings:
    meter = SavedBytes()
    saved: dict[str, list[tuple[PieceStats, float]]] = {}
    batches = []
    for k, step in enumerate(steps):
        progress(
            f"preparing batch {k + 1}/{len(steps)}: {len(step.sequences)} rows, "
            f"{step.forest.dense_tokens} tokens ({step.forest.unique_tokens} in the tree)"
        )
        runs = runs_of(k, step)
        calls = {}
        for name, (_, peak, fn) in runs.items():
            # The first call at a shape is untimed: it grows the allocator, runs first-use work and
            # measures the saves; its time (an upper bound, the meter adds to it) sizes the samples.
            model.zero_grad(set_to_none=True)
            start = clock()
            with meter.measure():
                fn()
            calls[name] = max(1, math.ceil(min_seconds / max(clock() - start, 1e-9)))
            if peak is not None:
                saved.setdefault(name, []).append(
                    (PieceStats(tokens=peak[0], scored=peak[1]), float(meter.peak))
                )
        batches.append((runs, calls))
    seconds: dict[str, list[list[float]]] = {name: [[] for _ in steps] for name in batches[0][0]}
    for rep in range(repeats):
        progress(f"timing repeat {rep + 1}/{repeats} of {len(steps)} batches")
        for k, (runs, calls) in enumerate(batches):
            for name, (_, _, fn) in runs.items():
                seconds[name][k].append(_timed(model, fn, calls[name], clock))
    model.zero_grad(set_to_none=True)
    stats = {name: [runs[name][0] for runs, _ in batches] for name in seconds}
    return _Timings(stats, seconds, saved)


def _runs(
    model,
    executors,
    step: Step,
    coefs: list[torch.Tensor],
    micro_batch_tokens,
    block_size,
    leaf_batch_tokens,
    gradient_checkpointing,
    score,
) -> dict[str, _Run]:
    """Every path's :data:`_Run` on one batch (the scoring passes only with ``score``)."""
    # Token tensors made once, outside the timed calls, as a host's collated batch would be.
    seqs, sf = [torch.tensor(s) for s in step.sequences], step.score_from
    dense, dense_peak = dense_stats(step, micro_batch_tokens)
    tree, peaks = forest_stats(step.forest), tree_peaks(step, leaf_batch_tokens, block_size)
    runs: dict[str, _Run] = {
        "dense": (
            dense,
            dense_peak,
            lambda: _dense_train(model, seqs, sf, coefs, micro_batch_tokens, gradient_checkpointing),
        ),
    }
    if score:
        runs["score:dense"] = (
            dense,
            None,
            lambda: dense_step(model, seqs, sf, coefs, micro_batch_tokens, grad=False),
        )
        runs["score:tree"] = (tree, None, lambda: executors["keep"].score(step.forest))
    for mode, ex in executors.items():
        runs[mode] = (tree, peaks[mode], lambda ex=ex: ex.backward(step.forest, coefs))
    return runs


def _executors(model, block_size, leaf_batch_tokens):
    executors, refused = {}, {}
    for mode in TREE_MODES:
        try:
            executors[mode] = TreeExecutor(
                model,
                mode=mode,
                block_size=block_size if mode == "replay" else None,
                leaf_batch_tokens=leaf_batch_tokens,
            )
        except UnsupportedModelError as err:
            refused[mode] = str(err)
    if "keep" not in executors:
        raise UnsupportedModelError(f"this model cannot run on a tree: {refused['keep']}")
    return executors, refused


def _warm_up(model, executors, vocab, micro_batch_tokens) -> None:
    """One small step of every path first (allocator, kernels, the executors' first-use probes)."""
    seqs, sf, coefs = grpo_batch(32, 2, 8, vocab, seed=99)
    step = Step([s.tolist() for s in seqs], sf)
    dense_step(model, seqs, sf, coefs, micro_batch_tokens, grad=True)
    for ex in executors.values():
        ex.backward(step.forest, coefs)
    model.zero_grad(set_to_none=True)


def _dense_train(model, seqs, sf, coefs, max_tokens, gradient_checkpointing) -> None:
    if not gradient_checkpointing:
        dense_step(model, seqs, sf, coefs, max_tokens, grad=True)
        return
    set_checkpointing(model, True)
    try:
        dense_step(model, seqs, sf, coefs, max_tokens, grad=True)
    finally:
        set_checkpointing(model, False)


def _per_token(samples: list[tuple[PieceStats, float]]) -> tuple[float, float]:
    fit = CostModel.fit([s for s, _ in samples], [b for _, b in samples])
    return fit.per_token, fit.per_scored


# ---------------------------------------------------------------------------- from the config


def _processor() -> str:
    """The machine's processor in a few words (``/proc/cpuinfo``'s model name where there is one)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _config_sizes(config) -> dict[str, int]:
    text = getattr(config, "text_config", None) or config
    hidden = text.hidden_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    experts = getattr(text, "num_experts_per_tok", None) or 0
    moe_inter = getattr(text, "moe_intermediate_size", None) or 0
    shared = getattr(text, "n_shared_experts", None) or getattr(text, "num_shared_experts", None) or 0
    inter = experts * moe_inter + shared * moe_inter if experts and moe_inter else text.intermediate_size
    return {
        "hidden": hidden,
        "layers": text.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "inter": inter,
        "vocab": text.vocab_size,
    }


def _cache_bytes_per_token(config, element_size: int) -> float:
    s = _config_sizes(config)
    return float(s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * element_size)


def config_flops(config) -> tuple[float, float, float]:
    """Forward FLOPs from a model config: (per token in the linear layers, per query-key pair in
    attention, per scored row in the LM head). Dense or MoE (active experts) decoders."""
    s = _config_sizes(config)
    qkvo = s["hidden"] * s["heads"] * s["head_dim"] * 2 + 2 * s["hidden"] * s["kv_heads"] * s["head_dim"]
    linear = 2 * s["layers"] * (qkvo + 3 * s["hidden"] * s["inter"])
    attn = s["layers"] * 4 * s["heads"] * s["head_dim"]
    return float(linear), float(attn), float(2 * s["hidden"] * s["vocab"])


def config_pricing(config, element_size: int = 2) -> Pricing:
    """FLOP pricing (forward + backward = 3 forwards for training), the same model for every tree
    mode; saved bytes from the decoder's usual saved tensors (about 10 hidden and 4 intermediate
    values per token per layer, the head's logits and log-softmax per scored row)."""
    linear, attn, head = config_flops(config)
    forward = CostModel(per_token=linear, per_attended=attn, per_unit=0.0, per_scored=head)
    train = CostModel(per_token=3 * linear, per_attended=3 * attn, per_unit=0.0, per_scored=3 * head)
    s = _config_sizes(config)
    per_token = float(s["layers"] * (10 * s["hidden"] + 4 * s["inter"]) * element_size)
    per_scored = float(2 * s["vocab"] * 4)
    return Pricing(
        how="priced from the config's FLOPs, the ideal of no device (no timings: the tree modes are not told "
        "apart); on one H200 at the 0.5B shape keep measured 3.0x where this ideal is 6.7x (depth-first "
        "keep, benchmarks/results/gpu.md)",
        costs=PathCosts(
            train={"dense": train, **dict.fromkeys(TREE_MODES, train)},
            score={"dense": forward, "tree": forward},
        ),
        saved_bytes={"dense": (per_token, per_scored), **dict.fromkeys(TREE_MODES, (per_token, per_scored))},
        cache_bytes_per_token=_cache_bytes_per_token(config, element_size),
    )
