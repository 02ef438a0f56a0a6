"""Objective bridge: a host's own loss, evaluated on leaf tensors, made exact on a prefix forest.

Hosts define their policy losses on tensors in their own layout, per micro-batch. Rather than
rewriting them, the bridge evaluates the host's loss function on the tree's log-probs (and
entropies) held as leaf tensors in that layout, takes its gradient with respect to each token's
value, and hands those coefficients to :meth:`TreeExecutor.backward`. Since the parameter gradient
is ``sum_tokens dL/dlogprob * dlogprob/dtheta``, the result equals the plain computation exactly.

Three ways to get the coefficients (``loss_gradient``):
    ``"general"``: any loss. A no-grad scoring pass gives the values, the loss's gradient is taken
        there, then one backward pass (two passes in all).
    ``"constant"``: the host says the gradient cannot depend on the values (on-policy GRPO: the
        ratio is ``exp(logp - logp.detach())``, no KL, no value-dependent masks). The gradient is
        taken at two synthetic points, quietly; if they agree bitwise it drives one fused pass,
        otherwise the general path runs (``WindowResult.path`` says which ran).
    ``"token_local"``: each token's coefficient depends only on its own value (token-level clipped
        PPO against old log-probs, k1/k3 KL): formed chunk by chunk during the one pass.

Every path checks the loss and its gradient for NaN/inf before anything is accumulated (the
token-local path also per chunk, and says so when it stops part way).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from ..executor import RouterLoss, ScoreResult, TreeExecutor
from ..tree import PrefixForest, RowLayout, Window
from .token_local import TokenLocalCoefficients
from .window import Quiet, WindowLoss, check_finite, gradient, probe_points
from .window import evaluate as evaluate_losses

logger = logging.getLogger(__name__)

__all__ = [
    "LOSS_GRADIENTS",
    "LossFn",
    "LossGradient",
    "ObjectiveResult",
    "WindowResult",
    "backward_loss",
    "backward_window",
    "pad",
    "unpad",
]

LossGradient = Literal["general", "constant", "token_local"]
LOSS_GRADIENTS: tuple[str, ...] = get_args(LossGradient)
# loss_fn(logprobs [B, T], entropies [B, T] or None, mask [B, T] bool) -> scalar (backward_loss)
LossFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]


@dataclass
class WindowResult:
    """Outcome of :func:`backward_window`.

    Attributes:
        losses: one detached scalar per micro-batch (the host's loss on the real values).
        score: the values the loss saw: per-sequence log-probs (and entropies), detached.
        path: the path that ran: ``"general"``, ``"constant"`` or ``"token_local"``.
        score_time: seconds in the scoring pass (0 without one).
        backward_time: seconds in the backward pass.
    """

    losses: list[torch.Tensor]
    score: ScoreResult
    path: str
    score_time: float
    backward_time: float

    @property
    def logprobs(self) -> list[torch.Tensor]:
        """One ``[len_i - score_from_i]`` tensor per sequence."""
        return self.score.logprobs

    @property
    def entropies(self) -> list[torch.Tensor] | None:
        return self.score.entropies

    @property
    def loss(self) -> torch.Tensor:
        """The window's total loss."""
        return torch.stack(self.losses).sum()


def _nonzero(grads: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """None when every gradient is zero (the pass then skips the entropy backward)."""
    return grads if grads is not None and any(bool(g.any()) for g in grads) else None


def _constant_gradient(window, loss_fn, entropy, quiet, dtype, device):
    """The gradient at two probe points if it agrees bitwise there (checked finite), else None."""
    probes = []
    for lps, ents in probe_points(window, dtype, device):
        with quiet():
            probes.append(gradient(window, loss_fn, lps, ents if entropy else None))
    (loss0, lp0, ent0), (_, lp1, ent1) = probes
    pairs = list(zip(lp0, lp1, strict=True)) + list(zip(ent0 or [], ent1 or [], strict=True))
    if not all(torch.equal(a, b) for a, b in pairs):
        return None
    check_finite(loss0, lp0, ent0)
    return lp0, _nonzero(ent0)


def backward_window(
    executor: TreeExecutor,
    forest: PrefixForest,
    window: Window,
    loss_fn: WindowLoss,
    loss_gradient: LossGradient = "general",
    entropy: bool = False,
    quiet: Quiet | None = None,
    fill: Sequence[torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    router: RouterLoss | None = None,
) -> WindowResult:
    """Accumulate into ``param.grad`` the exact gradient of a host loss over one optimizer step.

    Args:
        executor: runs the model.
        forest: the forest of ``window``'s rows (``window.forest()``).
        window: the step's micro-batches, each a :class:`RowLayout` in the host's layout.
        loss_fn: ``(i, logprobs, entropies) -> scalar``: micro-batch ``i``'s loss on tensors of its
            layout's ``shape`` (entropies None unless ``entropy``).
        loss_gradient: ``"general"``, ``"constant"`` or ``"token_local"`` (module docstring).
        entropy: the loss reads entropies.
        quiet: a context in which ``loss_fn`` has no side effects (probes, chunks); default none.
        fill: token-local path: per micro-batch flat ``[N_i]`` values outside a chunk.
        device: where the leaves the loss sees live (default: the executor's device).
        router: the MoE router load-balancing loss of the micro-batches, bound to ``forest``
            and ``window.rows``: its gradient is added (counted in the scoring pass where there is
            one); ``router.values()`` are known to ``loss_fn`` from the scoring pass on (general
            path) or after the backward (the values ``WindowResult.losses`` are evaluated at).

    Returns:
        :class:`WindowResult`.

    Raises:
        ValueError: when the loss or its gradient is not finite (before anything is accumulated),
            or ``window`` does not match ``forest``.
        TypeError: when ``loss_fn`` does not return a scalar tensor.
    """
    if loss_gradient not in LOSS_GRADIENTS:
        raise ValueError(f"loss_gradient={loss_gradient!r} is not one of {LOSS_GRADIENTS}")
    if len(window.sequences) != forest.num_sequences:
        raise ValueError(
            f"the window has {len(window.sequences)} rows but the forest {forest.num_sequences} sequences: build the "
            "forest with window.forest()"
        )
    quiet = quiet or contextlib.nullcontext
    device = torch.device(device) if device is not None else executor.device
    dtype = executor.dtype
    if loss_gradient == "token_local":
        return _token_local(executor, forest, window, loss_fn, entropy, quiet, fill, device, router)
    if loss_gradient == "constant":
        coefs = _constant_gradient(window, loss_fn, entropy, quiet, dtype, device)
        if coefs is not None:
            return _fused(executor, forest, window, loss_fn, entropy, coefs, device, router)
        logger.info("the loss gradient depends on the log-prob values here: running a scoring pass first")
    start = time.perf_counter()
    res = executor.score(forest, entropy=entropy, router=router)
    score_time = time.perf_counter() - start
    lp = [t.to(device) for t in window.flat(res.logprobs)]
    ent = [t.to(device) for t in window.flat(res.entropies)] if entropy else None
    losses, g_lp, g_ent = gradient(window, loss_fn, lp, ent)
    g_lp, g_ent = executor.combine(losses, g_lp, g_ent)
    check_finite(losses, g_lp, g_ent)
    g_ent = _nonzero(g_ent)
    start = time.perf_counter()
    executor.backward(
        forest,
        grad_logprobs=window.per_sequence(g_lp),
        grad_entropies=window.per_sequence(g_ent) if g_ent is not None else None,
        router=router,
    )
    return WindowResult(losses, res, "general", score_time, time.perf_counter() - start)


def _fused(executor, forest, window, loss_fn, entropy, coefs, device, router) -> WindowResult:
    g_lp, g_ent = coefs
    start = time.perf_counter()
    res = executor.backward(
        forest,
        grad_logprobs=window.per_sequence(g_lp),
        grad_entropies=window.per_sequence(g_ent) if g_ent is not None else None,
        entropy=entropy,
        router=router,
    )
    backward_time = time.perf_counter() - start
    with torch.no_grad():  # the real values, for the host's loss value and its metrics
        lp = [t.to(device) for t in window.flat(res.logprobs)]
        ent = [t.to(device) for t in window.flat(res.entropies)] if entropy else None
        losses = [x.detach() for x in evaluate_losses(window, loss_fn, lp, ent)]
    return WindowResult(losses, res, "constant", 0.0, backward_time)


def _token_local(executor, forest, window, loss_fn, entropy, quiet, fill, device, router) -> WindowResult:
    coef = TokenLocalCoefficients(forest, window, loss_fn, fill=fill, entropy=entropy, quiet=quiet)
    coef.check(device)
    start = time.perf_counter()
    res = executor.backward(forest, coefficient_fn=coef, entropy=entropy, router=router)
    backward_time = time.perf_counter() - start
    with torch.no_grad():
        lp = [t.to(device) for t in window.flat(res.logprobs)]
        ent = [t.to(device) for t in window.flat(res.entropies)] if entropy else None
        losses = [x.detach() for x in evaluate_losses(window, loss_fn, lp, ent)]
    return WindowResult(losses, res, "token_local", 0.0, backward_time)


# ---------------------------------------------------------------------------- one padded batch


def pad(per_sequence: Sequence[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack per-sequence 1-D tensors into a right-padded batch.

    Returns:
        ``[B, T]`` values and ``[B, T]`` bool mask, ``T`` the longest length (at least 1).
    """
    lengths = [len(t) for t in per_sequence]
    width = max(1, max(lengths, default=0))
    dtype = per_sequence[0].dtype if per_sequence else torch.float32
    device = per_sequence[0].device if per_sequence else torch.device("cpu")
    out = torch.full((len(per_sequence), width), value, dtype=dtype, device=device)
    mask = torch.zeros(len(per_sequence), width, dtype=torch.bool, device=device)
    for i, t in enumerate(per_sequence):
        out[i, : len(t)] = t
        mask[i, : len(t)] = True
    return out, mask


def unpad(padded: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Rows of ``[B, T]`` cut back to their lengths."""
    return [padded[i, :n] for i, n in enumerate(lengths)]


@dataclass
class ObjectiveResult:
    """Outcome of :func:`backward_loss`.

    Attributes:
        loss: the loss value (detached scalar).
        logprobs: ``[B, T]`` padded log-probs the pass computed (detached).
        entropies: ``[B, T]`` or None.
        mask: ``[B, T]`` bool.
        score: the executor's per-sequence result.
    """

    loss: torch.Tensor
    logprobs: torch.Tensor
    entropies: torch.Tensor | None
    mask: torch.Tensor
    score: ScoreResult


def backward_loss(
    executor: TreeExecutor,
    forest: PrefixForest,
    loss_fn: LossFn,
    token_local: bool,
    entropy: bool = False,
    fill: torch.Tensor | None = None,
) -> ObjectiveResult:
    """Accumulate into ``param.grad`` the exact gradient of a loss on the forest's sequences.

    The loss sees one right-padded batch: row ``i`` holds sequence i's scored tokens
    (``len_i - score_from_i`` of them) left-aligned, ``mask`` marks the real ones. For several
    micro-batches in a host's own layout use :func:`backward_window`.

    Args:
        executor: runs the model.
        forest: the batch.
        loss_fn: ``(logprobs [B, T], entropies [B, T] or None, mask [B, T]) -> scalar tensor``.
        token_local: True when each token's ``dL/dlogprob`` depends only on its own log-prob
            (and entropy): one fused pass. False: a no-grad scoring pass, then one backward pass.
        entropy: the loss reads entropies.
        fill: token-local path only: ``[B, T]`` values for slots outside a chunk (e.g. old log-probs).

    Returns:
        :class:`ObjectiveResult` with the loss value.

    Raises:
        ValueError: when the loss or its gradient is not finite, before anything is accumulated
            (the token-local path also checks each chunk and says when it stops part way).
        TypeError: when ``loss_fn`` does not return a scalar tensor.
    """
    layout = RowLayout.spans(
        [forest.sequence_tokens(s) for s in range(forest.num_sequences)], forest.score_from
    )
    window = Window([layout])
    mask = layout.mask(executor.device)
    if fill is not None and tuple(fill.shape) != layout.shape:
        raise ValueError(
            f"fill has shape {tuple(fill.shape)} but the padded layout of this forest is {layout.shape} "
            "(sequences x longest scored span): pad or cut it to that width"
        )
    res = backward_window(
        executor,
        forest,
        window,
        lambda i, lp, ent: loss_fn(lp, ent, mask.to(lp.device)),
        loss_gradient="token_local" if token_local else "general",
        entropy=entropy,
        fill=[layout.from_host(fill)] if fill is not None else None,
    )
    lp, lp_mask = pad(res.logprobs)
    ent = pad(res.entropies)[0] if res.entropies is not None else None
    return ObjectiveResult(res.loss, lp, ent, lp_mask, res.score)
