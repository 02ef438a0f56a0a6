"""Attention of a tree node over its ancestors' cache without a materialised mask (CPU).

A node of ``q`` tokens attends to all ``c`` cached positions of its ancestors and causally to
itself. transformers expresses that with a ``[q, c + q]`` mask, which on the CPU is also kept for
backward and grows with the context (a 2048-token block over a 128k-token prompt holds a 1 GiB
float mask). Here the two parts run as two flash-attention calls, one unmasked over the cache and
one causal over the node, merged by their log-sum-exp:

    lse = log(exp(lse_past) + exp(lse_self))
    out = out_past * exp(lse_past - lse) + out_self * exp(lse_self - lse)

and backward runs the flash backward of each part with the merged ``out`` and ``lse``, which gives
each part's exact share of the gradient (the same identity ring attention uses).

The cache reaches the attention as the ancestors' own tensors, one piece per node or replay block
(:class:`PastPieces`, attached to the node's keys by the executor's cache), and each piece is one
more part of the merge. Concatenating them, as transformers' cache does, would copy the whole
context for every node: for long-context replay that copy was half again the memory of the cache
and its gradient together. Query heads that share a key/value head are folded into the query
length for the unmasked parts, so the pieces are not expanded to the query heads either.

Registered with transformers' ``AttentionInterface`` under :data:`NAME` at first use
(:func:`forkrl.core.attention.select`); the executor selects it for the duration of a tree pass
only, for models using sdpa whose layers all attend fully (no sliding window, no logit
softcapping). Anything else falls back to plain sdpa with an explicit mask.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .. import compat

__all__ = ["NAME", "PastPieces", "split_attention"]

NAME = "forkrl_tree_sdpa"

# Split only where the mask it avoids is large: below this many [query, past] elements one masked
# kernel call is faster than two calls and a merge (measured on the CPU: 10% slower at 256 x 2048,
# 1.5x faster and 3.5x less autograd memory at 2048-token blocks over a 16k prompt).
MIN_SPLIT_ELEMENTS = 1 << 22

# Cache pieces shorter than this are concatenated before attention (kernel calls per piece).
MIN_PIECE = 1024

_flash = compat.flash_cpu
_flash_bwd = compat.flash_cpu_backward


def _expand(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, kv, L, d]`` -> ``[B, kv * n_rep, L, d]`` (query heads of a group share a kv head)."""
    if n_rep == 1:
        return x
    b, kv, length, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, length, d).reshape(b, kv * n_rep, length, d)


def _reduce(g: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return g
    b, h, length, d = g.shape
    return g.view(b, h // n_rep, n_rep, length, d).sum(2)


class _SplitAttention(torch.autograd.Function):
    """Attention over cache pieces (unmasked) and the node itself (causal), merged by log-sum-exp.

    The pieces are the ancestors' own key/value tensors, saved by reference: nothing of the size of
    the context is copied. Query heads that share a key/value head are folded into the query length
    for the unmasked parts, so the pieces are never expanded to the query heads either.
    """

    @staticmethod
    def forward(ctx, q, k_self, v_self, scale: float, n_rep: int, n_pieces: int, *pieces):  # noqa: D102
        b, h, q_len, d = q.shape
        kv = h // n_rep
        q = q.contiguous()
        out, lse = _flash(q, _expand(k_self, n_rep), _expand(v_self, n_rep), 0.0, True, scale=scale)
        out, lse = out.contiguous(), lse.contiguous()
        q_fold = q.view(b, kv, n_rep * q_len, d)
        for k, v in zip(pieces[:n_pieces], pieces[n_pieces:], strict=True):
            o_i, l_i = _flash(q_fold, k, v, 0.0, False, scale=scale)
            o_i, l_i = o_i.reshape(b, h, q_len, d), l_i.reshape(b, h, q_len)
            merged = torch.logaddexp(lse, l_i)
            out = out * torch.exp(lse - merged)[..., None] + o_i * torch.exp(l_i - merged)[..., None]
            lse = merged
        ctx.save_for_backward(q, k_self, v_self, out, lse, *pieces)
        ctx.scale, ctx.n_rep, ctx.n_pieces = scale, n_rep, n_pieces
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        q, k_self, v_self, out, lse, *pieces = ctx.saved_tensors
        n_rep, scale, n = ctx.n_rep, ctx.scale, ctx.n_pieces
        b, h, q_len, d = q.shape
        dout = dout.contiguous()
        dq, dk_self, dv_self = _flash_bwd(
            dout, q, _expand(k_self, n_rep), _expand(v_self, n_rep), out, lse, 0.0, True, scale=scale
        )
        fold = (b, h // n_rep, n_rep * q_len)
        dout_f, q_f, out_f, lse_f = (t.reshape(*fold, *t.shape[3:]) for t in (dout, q, out, lse))
        dks, dvs = [], []
        for k, v in zip(pieces[:n], pieces[n:], strict=True):
            dq_i, dk, dv = _flash_bwd(dout_f, q_f, k, v, out_f, lse_f, 0.0, False, scale=scale)
            dq = dq + dq_i.reshape(b, h, q_len, d)
            dks.append(dk)
            dvs.append(dv)
        return (dq, _reduce(dk_self, n_rep), _reduce(dv_self, n_rep), None, None, None, *dks, *dvs)


def _coalesce(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """Concatenate runs of short pieces (one kernel call per piece costs more than a small copy)."""
    out: list[torch.Tensor] = []
    run: list[torch.Tensor] = []
    run_len = 0

    def flush() -> None:
        nonlocal run, run_len
        if run:
            out.append(torch.cat(run, dim=-2) if len(run) > 1 else run[0])
        run, run_len = [], 0

    for p in pieces:
        if p.shape[-2] >= MIN_PIECE:
            flush()
            out.append(p)
            continue
        run.append(p)
        run_len += p.shape[-2]
        if run_len >= MIN_PIECE:
            flush()
    flush()
    return out


class PastPieces:
    """The ancestors' keys/values of one layer, kept as separate pieces (attached to the node's keys).

    :class:`forkrl.core.models.ModelAdapter` hands them to :func:`split_attention` this way instead
    of concatenating them with the node's keys, which would copy the whole context for every node.
    ``used`` counts the attention calls that consumed them (the adapter checks it is one).

    Args:
        keys, values: one ``[B, kv, n_i, d]`` tensor per ancestor piece, in position order.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = keys, values
        self.length = sum(k.shape[-2] for k in keys)
        self.used = 0

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, kv, c, d]`` keys and values (a copy; for the short contexts that take one kernel)."""
        cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs, dim=-2)  # noqa: E731
        return cat(self.keys), cat(self.values)


def split_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: a node's queries over its ancestors' cache and itself.

    Args:
        query: ``[B, H, q, d]``.
        key, value: ``[B, kv, q, d]``, the node's own keys/values, carrying the ancestors' as a
            :class:`PastPieces` attribute (``key.forkrl_past``); or ``[B, kv, c + q, d]``, the
            ancestors' cache then the node's own, from a plain cache.
        attention_mask: must be None (this path is only selected where no mask is needed).

    Returns:
        ``[B, q, H, d]`` attention output, and None for the weights.
    """
    if attention_mask is not None or kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise RuntimeError(f"{NAME} was selected for a layer that needs a mask; this is a forkrl bug")
    pieces: PastPieces | None = getattr(key, "forkrl_past", None)
    q_len = query.shape[2]
    n_rep = query.shape[1] // key.shape[1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if pieces is not None:
        pieces.used += 1
        past = pieces.length
        k_self, v_self = key, value
    else:
        past = key.shape[2] - q_len
        k_self, v_self = key[:, :, past:], value[:, :, past:]
    small = q_len * past < MIN_SPLIT_ELEMENTS
    if dropout > 0.0 or query.device.type != "cpu" or q_len == 1 or past == 0 or small:
        # Plain sdpa with an explicit bottom-right causal mask (dropout must use one kernel call).
        if pieces is not None and past > 0:
            k_past, v_past = pieces.full()
            key, value = torch.cat([k_past, key], dim=-2), torch.cat([v_past, value], dim=-2)
        kv_len = key.shape[2]
        mask = None
        if past > 0 and q_len > 1:
            rows = torch.arange(q_len, device=query.device)[:, None] + past
            mask = rows >= torch.arange(kv_len, device=query.device)[None, :]
        out = F.scaled_dot_product_attention(
            query,
            _expand(key, n_rep),
            _expand(value, n_rep),
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=past == 0 and q_len > 1,
            scale=scale,
        )
    else:
        if pieces is not None:
            keys, values = _coalesce(pieces.keys), _coalesce(pieces.values)
        else:
            keys, values = [key[:, :, :past]], [value[:, :, :past]]
        out = _SplitAttention.apply(query, k_self, v_self, scale, n_rep, len(keys), *keys, *values)
    return out.transpose(1, 2).contiguous(), None
