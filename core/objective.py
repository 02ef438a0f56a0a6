"""Objective bridge: any host loss on padded ``[batch, time]`` log-probs, exact on a prefix forest.

Hosts define their policy losses on padded tensors. Rather than rewriting them, the bridge
evaluates the host's own loss function on log-probs held as a leaf tensor, takes its gradient with
respect to each token's log-prob (and entropy), and hands those coefficients to
:meth:`TreeExecutor.backward`. Since the parameter gradient is ``sum_tokens dL/dlogprob *
dlogprob/dtheta``, the result equals the plain computation exactly.

Two paths:
    token-local: when each token's coefficient depends only on that token's own log-prob and
        entropy (token-level clipped PPO/GRPO, KL k1/k3, fixed normalisers), the coefficients are
        formed on the fly, chunk by chunk, during the one depth-first pass.
    two-pass: when tokens are coupled (sequence-level importance ratios as in GSPO, quantile
        masks, normalisers that depend on the log-probs), a no-grad scoring pass runs first.

Layout: row ``i`` of a padded tensor holds sequence i's scored tokens (``len_i - score_from_i``
of them) left-aligned; ``mask`` marks the real ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .executor import ScoreResult, TreeExecutor
from .tree import PrefixForest

__all__ = ["LossFn", "ObjectiveResult", "backward_loss", "pad", "unpad", "TokenLocalCoefficients"]

# loss_fn(logprobs [B, T], entropies [B, T] or None, mask [B, T] bool) -> scalar loss
LossFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]


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


def _scored_lengths(forest: PrefixForest) -> list[int]:
    return [n - s for n, s in zip(forest.lengths, forest.score_from, strict=True)]


class TokenLocalCoefficients:
    """Coefficient function for :meth:`TreeExecutor.backward` from a token-local padded loss.

    For each chunk of entries the executor computes, every (sequence, token) that scores one of
    them gets its current log-prob written into a padded leaf tensor (other slots hold ``fill``),
    the host loss is evaluated, and the gradient at those slots is summed per entry. This is exact
    when ``dL/dlogprob[i, t]`` depends on ``logprob[i, t]`` alone (and the entropy likewise).

    Args:
        forest: the batch.
        loss_fn: the host loss on padded tensors (see :data:`LossFn`).
        fill: ``[B, T]`` values for slots outside the chunk (default zeros); any finite values
            work for a token-local loss.
        entropy: whether the loss reads entropies.
    """

    def __init__(
        self,
        forest: PrefixForest,
        loss_fn: LossFn,
        fill: torch.Tensor | None = None,
        entropy: bool = False,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        self.loss_fn = loss_fn
        self.entropy = entropy
        lengths = _scored_lengths(forest)
        self.width = max(1, max(lengths))
        seq = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])
        pos = torch.cat([torch.arange(n) for n in lengths])
        entry = torch.cat(forest.seq_entries) if forest.seq_entries else torch.zeros(0, dtype=torch.long)
        order = torch.argsort(entry, stable=True)
        self.flat_seq, self.flat_pos, self.flat_entry = seq[order], pos[order], entry[order]
        counts = torch.bincount(entry, minlength=forest.num_entries)
        self.ptr = torch.zeros(forest.num_entries + 1, dtype=torch.long)
        self.ptr[1:] = torch.cumsum(counts, 0)
        self.mask = torch.zeros(len(lengths), self.width, dtype=torch.bool)
        for i, n in enumerate(lengths):
            self.mask[i, :n] = True
        if fill is not None and tuple(fill.shape) != tuple(self.mask.shape):
            raise ValueError(
                f"fill has shape {tuple(fill.shape)} but the padded layout of this forest is "
                f"{tuple(self.mask.shape)} (sequences x longest scored span): pad or cut it to that width"
            )
        self.fill = fill
        self.dtype = dtype

    def __call__(
        self, ids: torch.Tensor, logprobs: torch.Tensor, entropies: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = logprobs.device
        ids_cpu = ids.cpu()
        starts, ends = self.ptr[ids_cpu], self.ptr[ids_cpu + 1]
        counts = ends - starts
        # Flat (sequence, token) slots of every entry in the chunk, and which entry each belongs to.
        local = torch.repeat_interleave(torch.arange(len(ids_cpu)), counts)
        offs = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        flat = starts[local] + offs
        s, t = self.flat_seq[flat].to(device), self.flat_pos[flat].to(device)
        local = local.to(device)
        mask = self.mask.to(device)
        dtype = self.dtype
        base = (
            self.fill.to(device=device, dtype=dtype)
            if self.fill is not None
            else torch.zeros(mask.shape, dtype=dtype, device=device)
        )
        lp_pad = base.clone()
        lp_pad[s, t] = logprobs.to(dtype)[local]
        lp_pad.requires_grad_(True)
        ent_pad = None
        if self.entropy:
            if entropies is None:
                raise ValueError("the loss reads entropies: call backward with entropy=True")
            ent_pad = torch.zeros(mask.shape, dtype=dtype, device=device)
            ent_pad[s, t] = entropies.to(dtype)[local]
            ent_pad.requires_grad_(True)
        with torch.enable_grad():
            loss = self.loss_fn(lp_pad, ent_pad, mask)
            inputs = [lp_pad] if ent_pad is None else [lp_pad, ent_pad]
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        c_lp = torch.zeros(len(ids), dtype=dtype, device=device)
        if grads[0] is not None:
            c_lp.index_add_(0, local, grads[0][s, t])
        c_ent = None
        if ent_pad is not None:
            c_ent = torch.zeros(len(ids), dtype=dtype, device=device)
            if grads[1] is not None:
                c_ent.index_add_(0, local, grads[1][s, t])
        return c_lp, c_ent


@dataclass
class ObjectiveResult:
    """Outcome of :func:`backward_loss`.

    Attributes:
        loss: the host loss value (detached scalar).
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
    """Accumulate into ``param.grad`` the exact gradient of a host loss on the forest's sequences.

    Args:
        executor: runs the model.
        forest: the batch.
        loss_fn: ``(logprobs [B, T], entropies [B, T] or None, mask [B, T]) -> scalar``, in the
            padded layout of this module.
        token_local: True when each token's ``dL/dlogprob`` depends only on its own log-prob
            (and entropy): one fused pass. False: a no-grad scoring pass, then one backward pass.
        entropy: the loss reads entropies.
        fill: token-local path only: values for padded slots outside a chunk (e.g. old log-probs).

    Returns:
        :class:`ObjectiveResult` with the loss value.

    Raises:
        ValueError: when the loss or its gradient is not finite (nothing is accumulated then on
            the two-pass path; on the token-local path the check runs per chunk).
    """
    lengths = _scored_lengths(forest)
    if token_local:
        coef = TokenLocalCoefficients(forest, loss_fn, fill=fill, entropy=entropy)
        _precheck(coef, executor.device)
        res = executor.backward(forest, coefficient_fn=_checked(coef), entropy=entropy)
        lp, mask = pad(res.logprobs)
        ent = pad(res.entropies)[0] if res.entropies is not None else None
        with torch.no_grad():
            loss = loss_fn(lp.to(coef.dtype), ent.to(coef.dtype) if ent is not None else None, mask)
        return ObjectiveResult(loss.detach(), lp, ent, mask, res)

    res = executor.score(forest, entropy=entropy)
    lp, mask = pad(res.logprobs)
    lp_leaf = lp.detach().to(torch.float64).requires_grad_(True)
    ent_leaf = None
    if entropy:
        ent_leaf = pad(res.entropies)[0].detach().to(torch.float64).requires_grad_(True)
    with torch.enable_grad():
        loss = loss_fn(lp_leaf, ent_leaf, mask)
        inputs = [lp_leaf] if ent_leaf is None else [lp_leaf, ent_leaf]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    if not torch.isfinite(loss):
        raise ValueError(f"the loss is {loss.item()} (NaN/inf) on these rollouts; nothing was accumulated")
    g_lp = grads[0] if grads[0] is not None else torch.zeros_like(lp_leaf)
    g_ent = None
    if ent_leaf is not None:
        g_ent = grads[1] if grads[1] is not None else torch.zeros_like(ent_leaf)
    executor.backward(
        forest,
        grad_logprobs=unpad(g_lp, lengths),
        grad_entropies=unpad(g_ent, lengths) if g_ent is not None else None,
    )
    return ObjectiveResult(
        loss.detach(), lp, pad(res.entropies)[0] if entropy else None, mask, res
    )


def _precheck(coef: TokenLocalCoefficients, device: torch.device) -> None:
    # A token-local loss has the same finiteness at any log-prob value, so evaluating its gradient
    # once at the fill values catches NaN advantages before anything is accumulated.
    mask = coef.mask.to(device)
    if coef.fill is not None:
        lp = coef.fill.to(device=device, dtype=coef.dtype).clone()
    else:
        lp = torch.zeros(mask.shape, dtype=coef.dtype, device=device)
    lp.requires_grad_(True)
    ent = torch.zeros(mask.shape, dtype=coef.dtype, device=device, requires_grad=True) if coef.entropy else None
    with torch.enable_grad():
        loss = coef.loss_fn(lp, ent, mask)
        grads = torch.autograd.grad(loss, [lp] if ent is None else [lp, ent], allow_unused=True)
    for name, g in zip(("logprobs", "entropies"), grads, strict=False):
        if g is not None and not torch.isfinite(g[mask]).all():
            raise ValueError(
                f"the loss gradient with respect to {name} is NaN/inf for some tokens (e.g. NaN advantages or "
                "rewards): fix the inputs; nothing was accumulated"
            )


def _checked(coef: TokenLocalCoefficients) -> Callable:
    def fn(ids, logprobs, entropies):
        c_lp, c_ent = coef(ids, logprobs, entropies)
        if not torch.isfinite(c_lp).all() or (c_ent is not None and not torch.isfinite(c_ent).all()):
            raise ValueError(
                "the loss gradient is NaN/inf for some tokens (e.g. NaN advantages); param.grad is now partial: "
                "zero the gradients, fix the inputs and rerun"
            )
        return c_lp, c_ent

    return fn
