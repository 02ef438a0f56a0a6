"""What each path costs, per shape: fitted on the spot from timings of the user's model, or priced
from its config's FLOPs when the model is too large to time here.

Fitting builds the model from its config (random weights: a step's time does not depend on them),
times the stock path and each tree mode on a few small GRPO-shaped batches derived from the
workload, and fits one :class:`~forkrl.core.balance.CostModel` per path (seconds as a non-negative
linear function of tokens, attended pairs, units and scored rows). The shapes priced later are the
workload's own, larger ones: the fit never sees them. Autograd's saved bytes are measured on the
same batches, per held token and per scored row.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..balance.cost import CostModel, PieceStats
from ..balance.plan import forest_stats
from ..errors import UnsupportedModelError
from ..executor import TreeExecutor
from ..testing.memory import SavedBytes
from .workload import Step, dense_stats, tree_peaks

__all__ = [
    "TREE_MODES",
    "Pricing",
    "calibration_shapes",
    "config_pricing",
    "dense_step",
    "fit_pricing",
    "grpo_batch",
]

TREE_MODES = ("keep", "replay", "packed")


@dataclass
class Pricing:
    """Per path (``"dense"`` and each tree mode) its training cost model, the scoring cost models
    (``"dense"``, ``"tree"``), the saved bytes per held token and per scored row, and the key/value
    cache bytes per token (replay holds a path's cache without autograd)."""

    how: str
    train: dict[str, CostModel]
    score: dict[str, CostModel]
    saved_bytes: dict[str, tuple[float, float]]
    cache_bytes_per_token: float
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
    """The plain path on equal-length sequences: micro-batches of at most ``max_tokens`` tokens,
    logits only for the completions; with ``grad``, backward of ``sum(coef * logprob)``.

    Returns:
        Per micro-batch, its ``[rows, R]`` log-probs (detached).
    """
    length = len(seqs[0])
    mb = max(1, max_tokens // length)
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(seqs), mb):
        ids = torch.stack(list(seqs[i : i + mb])).to(device)
        sf = score_from[i]
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=ids, logits_to_keep=length - sf + 1, use_cache=False).logits[:, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, sf:, None])[..., 0]
            if grad:
                (lp * torch.stack(list(coefs[i : i + mb])).to(lp.device)).sum().backward()
        out.append(lp.detach())
    return out


# ---------------------------------------------------------------------------- fitting


def calibration_shapes(prompt: int, group: int, completion: int) -> list[tuple[int, int, int]]:
    """Six (P, G, R) around the workload's median prompt, group size and completion length: each
    halves one or two of them (so the fit never times the shape it prices, and extrapolates at
    most twice), capped at 2048 prompt tokens, 16 completions and 512 completion tokens (the fit
    stays within a minute on a CPU; larger workloads are extrapolated further)."""
    P, G, R = min(prompt, 2048), min(group, 16), min(completion, 512)
    p, g, r = max(8, P // 2), max(2, G // 2), max(8, R // 2)
    return [(p, G, R), (P, g, R), (P, G, r), (p, g, R), (p, G, r), (P, g, r)]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fit_pricing(
    model: nn.Module,
    shapes: list[tuple[int, int, int]],
    micro_batch_tokens: int,
    block_size: int,
    leaf_batch_tokens: int,
    gradient_checkpointing: bool = False,
    repeat: int = 2,
    progress: Callable[[str], None] = lambda _: None,
) -> Pricing:
    """Time every path on ``shapes`` (the fastest of ``repeat`` round-robin runs) and fit the models.

    Returns:
        A :class:`Pricing`; a tree mode the model refuses is in ``refused`` with the reason.
    """
    vocab = model.config.vocab_size
    model.train()
    executors, refused = _executors(model, block_size, leaf_batch_tokens)
    rows: dict[str, list[tuple[PieceStats, float]]] = {}
    saved: dict[str, list[tuple[PieceStats, float]]] = {}
    meter = SavedBytes()
    _warm_up(model, executors, vocab, micro_batch_tokens)
    for k, (P, G, R) in enumerate(shapes):
        progress(f"timing shape {k + 1}/{len(shapes)}: P={P} G={G} R={R}")
        runs = _runs(
            model,
            executors,
            grpo_batch(P, G, R, vocab, seed=k),
            micro_batch_tokens,
            block_size,
            leaf_batch_tokens,
            gradient_checkpointing,
        )
        best = {name: float("inf") for name in runs}
        for rep in range(repeat):
            for name, (_, peak, fn) in runs.items():
                model.zero_grad(set_to_none=True)
                with meter.measure() if rep == 0 and peak is not None else contextlib.nullcontext():
                    best[name] = min(best[name], _timed(fn))
                if rep == 0 and peak is not None:
                    saved.setdefault(name, []).append(
                        (PieceStats(tokens=peak[0], scored=peak[1]), float(meter.peak))
                    )
        for name, (stats, _, _) in runs.items():
            rows.setdefault(name, []).append((stats, best[name]))
    model.zero_grad(set_to_none=True)
    fits = {name: CostModel.fit([s for s, _ in r], [t for _, t in r]) for name, r in rows.items()}
    return Pricing(
        how=f"fitted on this machine from {len(shapes)} timed shapes",
        train={name: fit for name, fit in fits.items() if not name.startswith("score:")},
        score={"dense": fits["score:dense"], "tree": fits["score:tree"]},
        saved_bytes={name: _per_token(r) for name, r in saved.items()},
        cache_bytes_per_token=_cache_bytes_per_token(model.config, next(model.parameters()).element_size()),
        refused=refused,
    )


def _runs(model, executors, batch, micro_batch_tokens, block_size, leaf_batch_tokens, gradient_checkpointing):
    """Per path on one batch: its priced shape, the ``(tokens, scored)`` it holds at its peak
    (None for the no-grad scoring passes) and the step to time."""
    seqs, sf, coefs = batch
    step = Step([s.tolist() for s in seqs], sf)
    dense, dense_peak = dense_stats(step, micro_batch_tokens)
    tree, peaks = forest_stats(step.forest), tree_peaks(step, leaf_batch_tokens, block_size)
    runs = {
        "dense": (
            dense,
            dense_peak,
            lambda: _dense_train(model, seqs, sf, coefs, micro_batch_tokens, gradient_checkpointing),
        ),
        "score:dense": (
            dense,
            None,
            lambda: dense_step(model, seqs, sf, coefs, micro_batch_tokens, grad=False),
        ),
        "score:tree": (tree, None, lambda: executors["keep"].score(step.forest)),
    }
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
    with warnings.catch_warnings():  # transformers 5 renamed the API and warns on every call
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    try:
        dense_step(model, seqs, sf, coefs, max_tokens, grad=True)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_disable()


def _per_token(samples: list[tuple[PieceStats, float]]) -> tuple[float, float]:
    fit = CostModel.fit([s for s, _ in samples], [b for _, b in samples])
    return fit.per_token, fit.per_scored


# ---------------------------------------------------------------------------- from the config


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
        how="priced from the config's FLOPs (no timings: the tree modes are not told apart)",
        train={"dense": train, **dict.fromkeys(TREE_MODES, train)},
        score={"dense": forward, "tree": forward},
        saved_bytes={"dense": (per_token, per_scored), **dict.fromkeys(TREE_MODES, (per_token, per_scored))},
        cache_bytes_per_token=_cache_bytes_per_token(config, element_size),
    )
