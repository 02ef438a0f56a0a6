"""The LM head at a unit's scored rows: log-probs and entropies, and their coefficients' gradient.

Logits are formed only at the rows some sequence scores, in chunks of at most
``head_chunk_elems`` logits. In a gradient pass each chunk's coefficients (the host loss's
``d loss / d logprob`` and ``d loss / d entropy`` for its entries) are applied at once and
backpropagated to the rows' hidden states, which the executor later pushes into the unit's graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .model import HeadPrecision, ModelAdapter

__all__ = ["CoefficientFn", "ScoredHead", "StaticCoefficients"]

# (entry_ids [E], logprobs [E], entropies [E] or None) -> (d loss/d logprob [E], d loss/d entropy [E] or None)
CoefficientFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]
]


class StaticCoefficients:
    """Coefficients known before the pass: ``[num_entries]`` tensors indexed by entry id."""

    def __init__(self, coef_lp: torch.Tensor, coef_ent: torch.Tensor | None) -> None:
        self.coef_lp = coef_lp
        self.coef_ent = coef_ent

    def __call__(self, ids, logprobs, entropies):  # noqa: D102
        c_lp = self.coef_lp.to(ids.device)[ids]
        c_ent = self.coef_ent.to(ids.device)[ids] if self.coef_ent is not None else None
        return c_lp, c_ent


class ScoredHead:
    """Writes each entry's log-prob (and entropy) into ``lp``/``ent``; in grad mode applies ``coef``.

    Args:
        adapter: the model's head and logit scaling.
        temperature: divides the logits.
        chunk_elems: at most this many logits (rows x vocab) at once.
        lp: ``[num_entries]`` output log-probs.
        ent: ``[num_entries]`` output entropies, or None.
        coef: the coefficients of a gradient pass (None when scoring).
        precision: how the host computes its LM head (:meth:`ModelAdapter.logits`).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        temperature: float,
        chunk_elems: int,
        lp: torch.Tensor,
        ent: torch.Tensor | None,
        coef: CoefficientFn | None,
        precision: HeadPrecision = "model",
    ) -> None:
        self.adapter = adapter
        self.precision = precision
        self.temperature = temperature
        self.chunk = max(1, chunk_elems // adapter.head.weight.shape[0])
        self.lp, self.ent, self.coef = lp, ent, coef

    def unit(self, unit, hidden: torch.Tensor, grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The head at a unit's rows (``hidden``: ``[n, hidden]``); see :meth:`rows`."""
        if len(unit.rows) == 0:
            return None, None
        rows = hidden[unit.rows.to(hidden.device)]
        return self.rows(rows, unit.entry_row, unit.entry_ids, unit.entry_target, grad)

    def rows(
        self,
        rows: torch.Tensor,
        entry_row: torch.Tensor,
        entry_ids: torch.Tensor,
        entry_target: torch.Tensor,
        grad: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Log-probs of ``entry_target`` at ``rows`` (``[R, hidden]``), chunk by chunk.

        Args:
            entry_row: ``[E]`` non-decreasing row of each entry; ``entry_ids``, ``entry_target``: ``[E]``.
            grad: apply the coefficients and backpropagate to the rows.

        Returns:
            In grad mode, the ``[R, hidden]`` rows (in their graph) and their gradient; otherwise
            (None, None).
        """
        device = rows.device
        entry_row, entry_ids, entry_target = (t.to(device) for t in (entry_row, entry_ids, entry_target))
        src = rows.detach().requires_grad_(True) if grad else rows
        for r0 in range(0, rows.shape[0], self.chunk):
            r1 = min(r0 + self.chunk, rows.shape[0])
            e0, e1 = (int(torch.searchsorted(entry_row, r)) for r in (r0, r1))
            if e0 != e1:
                self._chunk(src[r0:r1], entry_row[e0:e1] - r0, entry_ids[e0:e1], entry_target[e0:e1], grad)
        if not grad:
            return None, None
        return rows, src.grad if src.grad is not None else torch.zeros_like(src)

    def _chunk(
        self, src: torch.Tensor, local: torch.Tensor, ids: torch.Tensor, target: torch.Tensor, grad: bool
    ):
        with torch.set_grad_enabled(grad):
            logp = torch.log_softmax(self.adapter.logits(src, self.temperature, self.precision), dim=-1)
            e_lp = logp[local, target]
            e_ent = -(logp.exp() * logp).sum(-1)[local] if self.ent is not None else None
        self.lp[ids] = e_lp.detach().to(self.lp.dtype)
        if e_ent is not None:
            self.ent[ids] = e_ent.detach().to(self.ent.dtype)
        if not grad:
            return
        c_lp, c_ent = self.coef(ids, e_lp.detach(), e_ent.detach() if e_ent is not None else None)
        loss = (c_lp.detach().to(e_lp.dtype) * e_lp).sum()
        if c_ent is not None:
            if e_ent is None:
                raise ValueError("an entropy coefficient was given but entropies were not computed")
            loss = loss + (c_ent.detach().to(e_ent.dtype) * e_ent).sum()
        if loss.requires_grad:
            loss.backward()
