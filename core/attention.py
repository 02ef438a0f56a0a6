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

Registered with transformers' ``AttentionInterface`` under :data:`NAME`; the executor selects it for
the duration of a tree pass only, for models using sdpa whose layers all attend fully (no sliding
window, no logit softcapping). Anything else falls back to plain sdpa with an explicit mask.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import AttentionInterface

__all__ = ["NAME", "split_attention"]

NAME = "forkrl_tree_sdpa"

# Split only where the mask it avoids is large: below this many [query, past] elements one masked
# kernel call is faster than two calls and a merge (measured on the CPU: 10% slower at 256 x 2048,
# 1.5x faster and 3.5x less autograd memory at 2048-token blocks over a 16k prompt).
MIN_SPLIT_ELEMENTS = 1 << 22

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


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
    @staticmethod
    def forward(ctx, q, k_past, v_past, k_self, v_self, scale: float, n_rep: int):  # noqa: D102
        o1, l1 = _flash(q, _expand(k_past, n_rep), _expand(v_past, n_rep), 0.0, False, scale=scale)
        o2, l2 = _flash(q, _expand(k_self, n_rep), _expand(v_self, n_rep), 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)  # [B, H, q]
        out = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
        ctx.save_for_backward(q, k_past, v_past, k_self, v_self, out, lse)
        ctx.scale, ctx.n_rep = scale, n_rep
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        q, k_past, v_past, k_self, v_self, out, lse = ctx.saved_tensors
        n_rep, scale = ctx.n_rep, ctx.scale
        dout = dout.contiguous()
        dq1, dk1, dv1 = _flash_bwd(
            dout, q, _expand(k_past, n_rep), _expand(v_past, n_rep), out, lse, 0.0, False, scale=scale
        )
        dq2, dk2, dv2 = _flash_bwd(
            dout, q, _expand(k_self, n_rep), _expand(v_self, n_rep), out, lse, 0.0, True, scale=scale
        )
        return (
            dq1 + dq2,
            _reduce(dk1, n_rep),
            _reduce(dv1, n_rep),
            _reduce(dk2, n_rep),
            _reduce(dv2, n_rep),
            None,
            None,
        )


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
    """transformers attention function: queries are the last ``q`` of the ``c + q`` key positions.

    Args:
        query: ``[B, H, q, d]``.
        key, value: ``[B, kv, c + q, d]``, the ancestors' cache then the node's own keys/values.
        attention_mask: must be None (this path is only selected where no mask is needed).

    Returns:
        ``[B, q, H, d]`` attention output, and None for the weights.
    """
    if attention_mask is not None or kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise RuntimeError(f"{NAME} was selected for a layer that needs a mask; this is a forkrl bug")
    q_len, kv_len = query.shape[2], key.shape[2]
    n_rep = query.shape[1] // key.shape[1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    past = kv_len - q_len
    small = q_len * past < MIN_SPLIT_ELEMENTS
    if dropout > 0.0 or query.device.type != "cpu" or q_len == 1 or past == 0 or small:
        # Plain sdpa with an explicit bottom-right causal mask (dropout must use one kernel call).
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
        out = _SplitAttention.apply(
            query,
            key[:, :, :past],
            value[:, :, :past],
            key[:, :, past:],
            value[:, :, past:],
            scale,
            n_rep,
        )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, split_attention)
