"""The LM head at a unit's scored rows: log-probs and entropies, and their coefficients' gradient.

Logits are formed only at the rows some sequence scores, in chunks of at most
``head_chunk_elems`` logits. In a gradient pass each chunk's coefficients (the host loss's
``d loss / d logprob`` and ``d loss / d entropy`` for its entries) are applied at once: the
gradient of the logits is written in closed form (below), its product with the weight is the rows'
hidden-state gradient, which the executor later pushes into the unit's graph, and its product with
the rows is added to one float32 weight-gradient buffer, handed to autograd once per pass
(:meth:`ScoredHead.flush`). No autograd graph is built per chunk and no backward runs per chunk.

For the log-softmax ``logp = z - logsumexp(z)`` of logits ``z`` (after temperature), probabilities
``p`` and entropy ``H = -sum p logp``, a row whose entries have coefficients ``a_e`` (on
``logp[t_e]``) and ``b_e`` (on ``H``) has ``dL/dz = onehot(a) - (sum a) p - (sum b) p (logp + H)``;
softcapping, logit scaling and the head's rounding are then undone in the order the forward
applied them. A head that is not a plain ``nn.Linear`` (a PEFT adapter on it) takes autograd per
chunk instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..attention import compute_dtype
from .model import HeadPrecision, ModelAdapter, _mm_float32
from .staging import HeadRows

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
        c_lp = self.coef_lp[ids]
        c_ent = self.coef_ent[ids] if self.coef_ent is not None else None
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
        self.fused = fusable(adapter.head)
        self._cast: torch.Tensor | None = None  # the weight in the head's compute dtype, this pass
        self._grad_w: torch.Tensor | None = None  # [vocab, hidden] float32 (or the weight's dtype)
        self._grad_b: torch.Tensor | None = None

    def unit(self, rows: HeadRows | None, hidden: torch.Tensor, grad: bool):
        """The head at one forward's rows (``hidden``: ``[n, hidden]``, batch rows flattened); see :meth:`rows`."""
        if rows is None or rows.num_rows == 0:
            return None, None
        return self.rows(rows.select(hidden), rows, grad)

    def rows(
        self, hidden: torch.Tensor, rows: HeadRows, grad: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Log-probs of ``rows``' entries at ``hidden`` (``[R, hidden]``, in its graph), chunk by chunk.

        Args:
            grad: apply the coefficients and backpropagate to the rows.

        Returns:
            In grad mode, the ``[R, hidden]`` rows (in their graph) and their gradient; otherwise
            (None, None).
        """
        src = hidden.detach()
        out = torch.empty_like(src) if grad and hidden.requires_grad else None
        bounds = rows.row_entries
        total = rows.num_rows
        for r0 in range(0, total, self.chunk):
            r1 = min(r0 + self.chunk, total)
            e0, e1 = int(bounds[r0]), int(bounds[r1])
            local = rows.entry_row[e0:e1] - r0
            ids, target = rows.entry_ids[e0:e1], rows.entry_target[e0:e1]
            if not grad:
                self._score(src[r0:r1], local, ids, target)
            elif self.fused:
                self._fused(src[r0:r1], local, ids, target, out[r0:r1] if out is not None else None)
            else:
                g = self._autograd(src[r0:r1], local, ids, target, need_rows=out is not None)
                if out is not None:
                    out[r0:r1] = g
        if not grad:
            return None, None
        return hidden, out

    # ------------------------------------------------------------------ the chunk kinds
    def _score(self, h: torch.Tensor, local, ids, target) -> None:
        with torch.no_grad():
            logp = torch.log_softmax(self.adapter.logits(h, self.temperature, self.precision), dim=-1)
            self.lp[ids] = logp[local, target].to(self.lp.dtype)
            if self.ent is not None:
                self.ent[ids] = _entropy(logp)[local].to(self.ent.dtype)

    def _autograd(self, h: torch.Tensor, local, ids, target, need_rows: bool) -> torch.Tensor | None:
        """A head autograd must differentiate (an adapter on it): one backward for the chunk."""
        src = h.requires_grad_(need_rows)
        with torch.enable_grad():
            logp = torch.log_softmax(self.adapter.logits(src, self.temperature, self.precision), dim=-1)
            e_lp = logp[local, target]
            e_ent = _entropy(logp)[local] if self.ent is not None else None
        self.lp[ids] = e_lp.detach().to(self.lp.dtype)
        if e_ent is not None:
            self.ent[ids] = e_ent.detach().to(self.ent.dtype)
        c_lp, c_ent = self.coef(ids, e_lp.detach(), e_ent.detach() if e_ent is not None else None)
        loss = (c_lp.detach().to(e_lp.dtype) * e_lp).sum()
        if c_ent is not None:
            if e_ent is None:
                raise ValueError("an entropy coefficient was given but entropies were not computed")
            loss = loss + (c_ent.detach().to(e_ent.dtype) * e_ent).sum()
        if loss.requires_grad:
            loss.backward()
        return src.grad if src.grad is not None else torch.zeros_like(src) if need_rows else None

    def _fused(self, h: torch.Tensor, local, ids, target, out: torch.Tensor | None) -> None:
        """Forward and backward of one chunk in closed form; the rows' gradient into ``out``."""
        ad = self.adapter
        with torch.no_grad():
            hc, wc, z = self._linear(h)  # z: [r, vocab] raw logits in the head's dtype
            s = z * ad.logit_scale if ad.logit_scale is not None else z
            t = torch.tanh(s / ad.softcap) if ad.softcap is not None else None
            y = t * ad.softcap if t is not None else s
            logits = y.float() if y.dtype in (torch.float16, torch.bfloat16) else y
            if self.temperature != 1.0:
                logits = logits / self.temperature
            logp = torch.log_softmax(logits, dim=-1)
            del logits
            e_lp = logp[local, target]
            p = logp.exp()
            ent = -(p * logp).sum(-1) if self.ent is not None else None  # [r]
            e_ent = ent[local] if ent is not None else None
            self.lp[ids] = e_lp.to(self.lp.dtype)
            if e_ent is not None:
                self.ent[ids] = e_ent.to(self.ent.dtype)
            c_lp, c_ent = self.coef(ids, e_lp, e_ent)
            c_lp = c_lp.to(logp.dtype)
            rows = logp.shape[0]
            a_row = torch.zeros(rows, dtype=logp.dtype, device=logp.device).index_add_(0, local, c_lp)
            if c_ent is not None:
                if ent is None:
                    raise ValueError("an entropy coefficient was given but entropies were not computed")
                b_row = torch.zeros_like(a_row).index_add_(0, local, c_ent.to(logp.dtype))
                g = logp.add_(ent[:, None]).mul_(p).mul_(-b_row[:, None])  # -(sum b) p (logp + H)
                g.sub_(p.mul_(a_row[:, None]))
            else:
                g = p.mul_(-a_row[:, None])
            del logp
            g.index_put_((local, target), c_lp, accumulate=True)
            if self.temperature != 1.0:
                g.div_(self.temperature)
            g = g.to(y.dtype)
            if t is not None:
                g = g * (1 - t * t)
            if ad.logit_scale is not None:
                g = g * ad.logit_scale
            self._linear_backward(h, hc, wc, g, out)

    # ------------------------------------------------------------------ the linear part
    def _linear(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(h_c, w_c, z)``: the rows and weight as the head multiplies them, and ``[r, vocab]`` logits."""
        head = self.adapter.head
        if self.precision == "model":
            if head.weight.is_floating_point() and h.dtype != head.weight.dtype:
                h = h.to(head.weight.dtype)  # as ModelAdapter.logits
            z = head(h)  # the module itself: autocast (and any forward hook) as the model runs it
            hc = h.to(z.dtype)
        else:
            dtype = torch.float32 if self.precision == "fp32" else compute_dtype(h.device, h.dtype)
            hc = h.to(dtype)
            with torch.autocast(h.device.type, enabled=False):
                z = hc @ self._weight(dtype).t()
                if head.bias is not None:
                    z = z + head.bias.to(dtype)
        return hc, self._weight(z.dtype), z

    def _weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The head's weight in ``dtype``, cast once per pass (autocast casts it once per forward)."""
        w = self.adapter.head.weight
        if w.dtype == dtype:
            return w.detach()
        if self._cast is None or self._cast.dtype != dtype:
            self._cast = w.detach().to(dtype)
        return self._cast

    def _linear_backward(self, h, hc, wc, g, out) -> None:
        """The rows' gradient (into ``out``) and the weight's and bias's (into the pass's buffers)
        from the raw logits' gradient ``g`` (``[r, vocab]`` in the head's dtype)."""
        head = self.adapter.head
        half = g.dtype in (torch.float16, torch.bfloat16)
        with torch.autocast(g.device.type, enabled=False):
            if out is not None:
                if self.precision == "model":
                    out.copy_(g @ wc)  # the half GEMM autograd runs, cast to the rows' dtype
                else:
                    out.copy_(_mm_float32(g, wc) if half else g @ wc)
            if head.weight.requires_grad:
                gw = _mm_float32(g.t(), hc) if half else g.t() @ hc
                if self._grad_w is None:
                    self._grad_w = gw.to(_accumulate_dtype(head.weight.dtype))
                else:
                    self._grad_w.add_(gw)
            if head.bias is not None and head.bias.requires_grad:
                gb = g.sum(0, dtype=_accumulate_dtype(head.bias.dtype))
                self._grad_b = gb if self._grad_b is None else self._grad_b.add_(gb)

    def flush(self) -> None:
        """Hand the pass's weight (and bias) gradient to autograd, once: it accumulates into
        ``.grad`` through the parameters' hooks as one backward of the head would."""
        head = self.adapter.head
        params, grads = [], []
        for param, grad in ((head.weight, self._grad_w), (getattr(head, "bias", None), self._grad_b)):
            if grad is not None:
                params.append(param)
                grads.append(grad.to(param.dtype))
        self._grad_w = self._grad_b = self._cast = None
        if params:
            torch.autograd.backward(params, grads)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def fusable(head: nn.Module) -> bool:
    """Whether the closed-form head applies: a plain ``nn.Linear`` without hooks of its own
    (an adapter on the head, or a hook that changes its output, needs autograd)."""
    return (
        type(head) is nn.Linear
        and not head._forward_hooks
        and not head._forward_pre_hooks
        and not head._backward_hooks
    )
