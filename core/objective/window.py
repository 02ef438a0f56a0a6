"""A host loss over one optimizer step's micro-batches, evaluated on flat log-prob leaves.

The host's loss runs per micro-batch on tensors in the host's own layout. Here the values of every
scored token of micro-batch ``i`` are one flat ``[N_i]`` leaf tensor (row by row, in position
order); :meth:`RowLayout.to_host` places them into the host's per-token tensors differentiably, so
the gradient with respect to the leaf is each token's coefficient ``d loss / d logprob`` (and
``d loss / d entropy``), ready for :meth:`TreeExecutor.backward`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from ..tree import Window

__all__ = ["Quiet", "WindowLoss", "check_finite", "evaluate", "gradient", "probe_points"]

# loss_fn(i, logprobs, entropies) -> scalar: micro-batch i's loss on tensors in its host layout
# (entropies None unless asked for), scaled as the host scales it before backward.
WindowLoss = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]
# A context in which the host's loss runs without side effects (metrics, state), for probes.
Quiet = Callable[[], contextlib.AbstractContextManager]


def _scalar(loss, i: int) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = (
            type(loss).__name__
            if not isinstance(loss, torch.Tensor)
            else f"a tensor of shape {tuple(loss.shape)}"
        )
        raise TypeError(
            f"loss_fn must return a scalar torch.Tensor that depends on the log-probs it was given (micro-batch {i}), "
            f"got {got}: compute the loss with torch operations on those tensors"
        )
    return loss.reshape(())


def evaluate(
    window: Window,
    loss_fn: WindowLoss,
    logprobs: Sequence[torch.Tensor],
    entropies: Sequence[torch.Tensor] | None,
) -> list[torch.Tensor]:
    """Every micro-batch's loss on flat values (``logprobs[i]``: ``[N_i]``); returns the scalars."""
    losses = []
    for i, lay in enumerate(window.layouts):
        lp = lay.to_host(logprobs[i])
        ent = lay.to_host(entropies[i]) if entropies is not None else None
        losses.append(_scalar(loss_fn(i, lp, ent), i))
    return losses


def gradient(
    window: Window,
    loss_fn: WindowLoss,
    logprobs: Sequence[torch.Tensor],
    entropies: Sequence[torch.Tensor] | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
    """The losses and their gradient with respect to each flat value.

    Returns:
        ``(losses, d total / d logprobs, d total / d entropies or None)``: one detached scalar and
        one ``[N_i]`` gradient per micro-batch (zeros where the loss does not read a value).
    """
    lp = [t.detach().clone().requires_grad_(True) for t in logprobs]
    ent = [t.detach().clone().requires_grad_(True) for t in entropies] if entropies is not None else None
    with torch.enable_grad():
        losses = evaluate(window, loss_fn, lp, ent)
        for i, loss in enumerate(losses):
            if not loss.requires_grad:  # what autograd refuses in a plain backward
                raise TypeError(
                    f"loss_fn returned a tensor that does not depend on the log-probs it was given (micro-batch {i}: "
                    "no grad_fn), so there is no gradient to take: compute the loss from those tensors (not from "
                    "detached copies or inside torch.no_grad()); nothing was accumulated"
                )
        total = torch.stack(losses).sum()
        leaves = lp + (ent or [])
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, leaves, strict=True)]
    n = len(lp)
    return [x.detach() for x in losses], grads[:n], (grads[n:] if ent is not None else None)


def probe_points(window: Window, dtype: torch.dtype, device: torch.device) -> list[tuple[list, list]]:
    """Two synthetic value sets (valid log-probs < 0, entropies > 0, not constant along a row) at
    which a value-independent loss gradient must agree."""
    points = []
    for value in (-1.0, -2.0):
        lps, ents = [], []
        for lay in window.layouts:
            ramp = (
                torch.cat([torch.arange(n, dtype=dtype) for n in lay.scored])
                if lay.scored
                else torch.zeros(0)
            )
            ramp = ramp.to(device=device, dtype=dtype)
            lps.append(value * (1.0 + 0.01 * ramp))
            ents.append(-value * (1.0 + 0.02 * ramp))
        points.append((lps, ents))
    return points


def check_finite(
    losses: list[torch.Tensor], g_lp: list[torch.Tensor], g_ent: list[torch.Tensor] | None
) -> None:
    """Raise, before anything is accumulated, when the loss or its gradient is not finite."""
    total = torch.stack(losses).sum()
    if not torch.isfinite(total):
        raise ValueError(
            f"the loss is {total.item()} (NaN/inf) on these rollouts (e.g. NaN rewards or advantages, a mean over no "
            "scored token): fix the inputs; nothing was accumulated"
        )
    for name, grads in (("logprobs", g_lp), ("entropies", g_ent or [])):
        if any(not torch.isfinite(g).all() for g in grads):
            raise ValueError(
                f"the loss gradient with respect to {name} is NaN/inf for some tokens (e.g. NaN advantages): fix the "
                "inputs; nothing was accumulated"
            )
