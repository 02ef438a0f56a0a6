"""torch's flash and memory-efficient attention ops, called directly by the split attention for the
log-sum-exp its merge needs."""

from __future__ import annotations

import torch

from .registry import CHECKED, Private


def _check_flash_cpu() -> None:
    q = torch.randn(1, 2, 3, 8)
    out, lse = flash_cpu(q, q, q, 0.0, True, scale=0.5)[:2]
    assert out.shape == q.shape and lse.shape == (1, 2, 3)
    grads = flash_cpu_backward(torch.ones_like(out), q, q, q, out, lse, 0.0, True, scale=0.5)
    assert len(grads) == 3


def flash_cpu(*args, **kwargs):
    """``aten._scaled_dot_product_flash_attention_for_cpu``: ``(out [B, H, q, d], lse [B, H, q])``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, **kwargs)


def flash_cpu_backward(*args, **kwargs):
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward``: ``(dq, dk, dv)``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, **kwargs)


def has_flash_cuda() -> bool:
    """Whether this torch has the CUDA flash-attention ops (the check runs on a GPU only)."""
    aten = torch.ops.aten
    return hasattr(aten, "_scaled_dot_product_flash_attention") and hasattr(
        aten, "_scaled_dot_product_flash_attention_backward"
    )


def flash_cuda(q, k, v, dropout_p: float, is_causal: bool, scale: float | None = None):
    """``aten._scaled_dot_product_flash_attention`` (CUDA, bf16/fp16, ``[B, H, L, d]``, head dim <=
    256) in the CPU kernel's form: ``(out [B, H, q, d], lse [B, H, q] float32)``. Checked on the device
    at first use by :func:`forkrl.core.attention.split.kernels_for` (no GPU in CI)."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, False, scale=scale
    )
    return out[0], out[1]


def flash_cuda_backward(
    dout, q, k, v, out, lse, dropout_p: float, is_causal: bool, scale: float | None = None
):
    """``aten._scaled_dot_product_flash_attention_backward`` in the CPU kernel's form: ``(dq, dk, dv)``.

    Dense (not varlen) inputs: the cumulative lengths go in undefined (None), as the dense forward
    returns them. A defined tensor, even an empty one, selects the varlen kernel, which then refuses
    it ("cu_seqlens_q must have dtype int32": seen on an H200, torch 2.11). Without dropout the RNG
    state is unused.
    """
    if dropout_p:
        raise ValueError("forkrl calls the CUDA flash backward without dropout only")
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        is_causal,
        empty,
        empty,
        scale=scale,
    )


def efficient_cuda(q, k, v, attn_mask: torch.Tensor, scale: float | None = None):
    """``aten._scaled_dot_product_efficient_attention`` (CUDA; an additive ``attn_mask``; as many key
    as query heads) in the CPU flash kernel's form: ``(out [B, H, q, d], lse [B, H, q] float32)``.
    Its log-sum-exp comes padded to a multiple of 32 queries and is cut to ``q``. Checked on the
    device at first use by :func:`forkrl.core.attention.level.level_kernels_for` (no GPU in CI)."""
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_mask, True, 0.0, False, scale=scale
    )
    return out, lse[..., : q.shape[2]]


def efficient_cuda_backward(dout, q, k, v, out, lse, attn_mask: torch.Tensor, scale: float | None = None):
    """``aten._scaled_dot_product_efficient_attention_backward`` without dropout: ``(dq, dk, dv)``;
    ``lse`` (``[B, H, q]``) is padded back to the kernel's multiple of 32 queries."""
    pad = -lse.shape[-1] % 32
    if pad:
        lse = torch.nn.functional.pad(lse, (0, pad))
    seed = torch.empty(0, dtype=torch.int64, device=q.device)  # no dropout: the RNG state is unused
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, attn_mask, out, lse, seed, seed, 0.0, [True, True, True, False], False, scale=scale
    )
    return dq, dk, dv


#: This area's entries (checked by ``tests/core/test_compat.py``).
PRIVATES: tuple[Private, ...] = (
    Private(
        "torch",
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu (+ _backward)",
        "the CPU flash kernel returns the log-sum-exp, which the split attention merges across cache pieces; "
        "its backward takes the merged output and log-sum-exp (the ring-attention identity)",
        _check_flash_cpu,
        CHECKED,
    ),
)
