"""Test-only: veRL's Ulysses sequence parallelism on the CPU, against which forkrl's engine is compared.

Stock veRL runs Ulysses attention through ``_ulysses_flash_attention_forward``: an all-to-all that
gathers the sequence and scatters the heads, then flash-attention's varlen kernel over the packed
sequences (found from ``position_ids``), then the reverse all-to-all. The all-to-alls are veRL's own
and run on gloo; only the CUDA kernel is replaced here (:func:`varlen_attention`: the same causal
softmax attention per packed sequence, with torch's sdpa), and the model is switched to
``flash_attention_2`` after loading (transformers refuses to load it without the flash-attn package).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def varlen_attention(query, key, value, attention_mask, query_length, *args, position_ids=None, **kwargs):
    """``_flash_attention_forward``'s contract on the CPU: ``query`` ``[1, S, H, d]``, ``key``/``value``
    ``[1, S, H_kv, d]``, packed sequences restarting ``position_ids`` at 0; causal within each."""
    if attention_mask is not None or position_ids is None or query.shape[0] != 1:
        raise NotImplementedError("the CPU stand-in serves veRL's packed (remove-padding) layout only")
    if kwargs.get("dropout", 0.0) or kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise NotImplementedError("the CPU stand-in has no dropout, sliding window or softcap")
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
    rep = query.shape[2] // key.shape[2]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [heads, S, d]
    k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    scale = kwargs.get("softmax_scale")
    pieces = [
        F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True, scale=scale)
        for a, b in zip(starts, starts[1:], strict=False)
        if b > a
    ]
    return torch.cat(pieces, dim=1).transpose(0, 1).unsqueeze(0).to(query.dtype)


def install() -> None:
    """Route veRL's Ulysses wrapper to :func:`varlen_attention` (it imported the CUDA entry by name)."""
    from verl.models.transformers import monkey_patch

    monkey_patch._flash_attention_forward = varlen_attention


def use_flash(worker) -> None:
    """Switch a built worker's model to ``flash_attention_2`` (served by veRL's patched entry)."""
    worker.engine.module.config._attn_implementation = "flash_attention_2"
