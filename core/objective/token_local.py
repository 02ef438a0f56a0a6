"""Coefficients formed during the pass, for token-local losses.

When each token's ``d loss / d logprob`` depends only on that token's own log-prob (and entropy),
as for token-level clipped PPO/GRPO against old log-probs or a k1/k3 KL term, the executor can form
the coefficients of each chunk of entries as it computes them: every (sequence, token) that scores
one of the chunk's entries gets its current value written into the flat leaves (other slots hold
``fill``), the host loss is evaluated, and the gradient at those slots is summed per entry. No
separate scoring pass is needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ..tree import PrefixForest, Window
from .window import Quiet, WindowLoss, check_finite, gradient

__all__ = ["TokenLocalCoefficients"]


class TokenLocalCoefficients:
    """Coefficient function for :meth:`TreeExecutor.backward` from a token-local host loss.

    Args:
        forest: the window's forest (its sequences are the window's rows, in order).
        window: the micro-batches.
        loss_fn: the host loss (see :data:`~forkrl.core.objective.window.WindowLoss`).
        fill: per micro-batch ``[N_i]`` values for slots outside a chunk (default zeros); any finite
            values work for a token-local loss (old log-probs keep the loss near its real value).
        entropy: whether the loss reads entropies.
        dtype: dtype of the leaves the loss sees.
        quiet: context in which the loss runs without side effects (it runs once per chunk).
    """

    def __init__(
        self,
        forest: PrefixForest,
        window: Window,
        loss_fn: WindowLoss,
        fill: Sequence[torch.Tensor] | None = None,
        entropy: bool = False,
        dtype: torch.dtype = torch.float64,
        quiet: Quiet | None = None,
    ) -> None:
        self.window, self.loss_fn, self.entropy, self.dtype, self.quiet = (
            window,
            loss_fn,
            entropy,
            dtype,
            quiet,
        )
        scored = [n for lay in window.layouts for n in lay.scored]
        entry = torch.cat(forest.seq_entries) if forest.seq_entries else torch.zeros(0, dtype=torch.long)
        # Global flat slot of every (sequence, token), sorted by the entry it reads.
        self.order = torch.argsort(entry, stable=True)
        counts = torch.bincount(entry, minlength=forest.num_entries)
        self.ptr = torch.zeros(forest.num_entries + 1, dtype=torch.long)
        self.ptr[1:] = torch.cumsum(counts, 0)
        self.sizes = [lay.num_scored for lay in window.layouts]
        self.total = sum(scored)
        if fill is not None:
            if len(fill) != len(self.sizes) or any(
                len(f) != n for f, n in zip(fill, self.sizes, strict=False)
            ):
                raise ValueError(
                    f"fill must give one flat tensor per micro-batch with its scored tokens {self.sizes}, got "
                    f"{[tuple(f.shape) for f in fill]}"
                )
            self.fill = torch.cat([f.detach().reshape(-1) for f in fill]).to(dtype)
        else:
            self.fill = torch.zeros(self.total, dtype=dtype)

    def values(self, slots: torch.Tensor | None = None, at: torch.Tensor | None = None):
        """Flat values per micro-batch: ``fill``, with ``at`` written at global ``slots``."""
        flat = self.fill.clone()
        if slots is not None:
            flat[slots] = at.to(self.dtype).cpu()
        return list(torch.split(flat, self.sizes))

    def _gradient(self, lp: list[torch.Tensor], ent: list[torch.Tensor] | None, device):
        lp = [t.to(device) for t in lp]
        ent = [t.to(device) for t in ent] if ent is not None else None
        with self.quiet() if self.quiet is not None else contextlib.nullcontext():
            return gradient(self.window, self.loss_fn, lp, ent)

    def check(self, device: torch.device) -> None:
        """Raise before anything is accumulated when the loss or its gradient is not finite.

        A token-local loss has the same finiteness at any log-prob values, so one evaluation at the
        fill values catches NaN advantages, a NaN constant term or a mean over no tokens.
        """
        ent = [torch.zeros(n, dtype=self.dtype) for n in self.sizes] if self.entropy else None
        check_finite(*self._gradient(self.values(), ent, device))

    def __call__(
        self, ids: torch.Tensor, logprobs: torch.Tensor, entropies: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = logprobs.device
        ids_cpu = ids.cpu()
        starts, ends = self.ptr[ids_cpu], self.ptr[ids_cpu + 1]
        counts = ends - starts
        # Global flat slots of every entry in the chunk, and which entry (of the chunk) each reads.
        local = torch.repeat_interleave(torch.arange(len(ids_cpu)), counts)
        offs = torch.arange(int(counts.sum())) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts
        )
        slots = self.order[starts[local] + offs]
        lp = self.values(slots, logprobs.detach().cpu()[local])
        ent = None
        if self.entropy:
            if entropies is None:
                raise ValueError("the loss reads entropies: call backward with entropy=True")
            flat = torch.zeros(self.total, dtype=self.dtype)
            flat[slots] = entropies.detach().cpu().to(self.dtype)[local]
            ent = list(torch.split(flat, self.sizes))
        _, g_lp, g_ent = self._gradient(lp, ent, device)
        g_lp = torch.cat(g_lp).to(device)
        local = local.to(device)
        slots = slots.to(device)
        c_lp = torch.zeros(len(ids), dtype=self.dtype, device=device).index_add_(0, local, g_lp[slots])
        c_ent = None
        if ent is not None:
            g = torch.cat(g_ent).to(device)
            c_ent = torch.zeros(len(ids), dtype=self.dtype, device=device).index_add_(0, local, g[slots])
        if not torch.isfinite(c_lp).all() or (c_ent is not None and not torch.isfinite(c_ent).all()):
            raise ValueError(
                "the loss gradient is NaN/inf for some tokens (e.g. NaN advantages); param.grad is now partial: "
                "zero the gradients, fix the inputs and rerun"
            )
        return c_lp, c_ent
