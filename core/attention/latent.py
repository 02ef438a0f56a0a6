"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, MiniCPM3, ...) of a tree node over
its ancestors' latent cache, split like :mod:`.split` and without per-head keys for the context.

MLA (DeepSeek-V2, arXiv 2405.04434, section 2.1) caches per token a normed latent ``c``
(``[kv_lora_rank]``) and one roped key ``k_rot`` (``[rope]``) shared by every head, and expands
them after the cache (``kv_b_proj``, weight viewed ``[H, nope + v, rank]`` as ``W_uk``, ``W_uv``):

    k_h = [W_uk_h c ; k_rot],    v_h = W_uv_h c

transformers expands after the cache returns the latent, so the ancestors' pieces the tree's cache
attaches to its returned tensor never reach the attention function (without the deferral the
probe refuses MLA models: "did not receive the keys its cache returned"). Here the expansion is deferred into the
attention (:func:`deferred_expand` replaces each module's ``expand_kv`` for a split pass), and the
up-projection is absorbed into the queries, the identity DeepSeek's own inference uses:

    q_h . k_h = [W_uk_h^T q_nope_h ; q_rot_h] . [c ; k_rot],    out_h = W_uv_h sum_j p_hj c_j

so head h's attention is multi-query attention with one key ``[c ; k_rot]`` and value ``c``. It runs
as :class:`.split._SplitAttention` with the value taken as the key itself (the flash kernels need
equal head dims; the output's rope dims are dropped) and all ``H`` heads folded into one query run
per piece: the cache pieces stay the latent (``rank + rope`` per token, not ``H * (nope + rope +
v)``), and the only per-head tensors are the node's queries and outputs. The gradient is exact:
the same sums, re-associated.

Where the absorption or the kernels do not apply (``kv_b_proj`` not a plain bias-free
``nn.Linear``, e.g. LoRA-wrapped or sharded; dropout; no flash kernel for ``rank + rope`` head
dims, as on CUDA for DeepSeek's 576; the root node) the module's own ``expand_kv`` runs over the
whole context and one masked sdpa call follows, as the model itself computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import compat
from .split import PastPieces, _coalesce, _SplitAttention, compute_dtype, kernels_for, masked_attention

__all__ = ["LatentKV", "absorbable_weight", "deferred_expand", "latent_attention"]


@dataclass
class LatentKV:
    """What an MLA module's deferred ``expand_kv`` hands the attention function (on the key).

    Attributes:
        module: the MLA attention module (its sizes, ``kv_b_proj`` and ``expand_kv``).
        latent: ``[B, 1, q, rank]`` the node's own normed latents.
        rope: ``[B, 1, q, rope]`` the node's own roped shared keys.
        pieces: the ancestors' latents (``keys``, ``[1, 1, n_i, rank]``) and roped keys (``values``,
            ``[1, 1, n_i, rope]``), or None at a root.
    """

    module: nn.Module
    latent: torch.Tensor
    rope: torch.Tensor
    pieces: PastPieces | None


def deferred_expand(
    module: nn.Module,
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The ``expand_kv`` an MLA module runs in a split pass: nothing is expanded; the latent (and
    the ancestors' pieces the cache attached to it) rides on the returned key as a :class:`LatentKV`.

    The returned function maps ``kv_nope [B, 1, q, rank]``, ``k_rot [B, 1, q, rope]`` to a key
    alias of ``kv_nope`` carrying ``forkrl_latent`` and ``k_rot`` as the value.
    """

    def expand_kv(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = kv_nope.view_as(kv_nope)
        key.forkrl_latent = LatentKV(module, kv_nope, k_rot, getattr(kv_nope, "forkrl_past", None))
        return key, k_rot

    return expand_kv


def absorbable_weight(module: nn.Module) -> torch.Tensor | None:
    """``kv_b_proj``'s weight ``[H * (nope + v), rank]`` where the queries can absorb it: a plain
    bias-free ``nn.Linear`` holding its whole weight; else None (the expanded path)."""
    proj = module.kv_b_proj
    if type(proj) is not nn.Linear or proj.bias is not None or compat.has_forward_hooks(proj):
        return None
    weight = proj.weight
    if compat.is_zero3_param(weight) or compat.is_dtensor(weight):
        return None
    return weight


def latent_attention(query: torch.Tensor, latent: LatentKV, dropout: float, scale: float) -> torch.Tensor:
    """A node's MLA over its ancestors' latent cache and itself (module docstring).

    Args:
        query: ``[B, H, q, nope + rope]`` (the model's query states, rope part last).
        latent: the node's latents and the ancestors' pieces (:class:`LatentKV`).
        dropout: attention dropout probability (> 0: the expanded path).
        scale: the softmax scale (the model's, for ``nope + rope`` dims).

    Returns:
        ``[B, H, q, v]`` attention output.
    """
    m, pieces = latent.module, latent.pieces
    past = 0 if pieces is None else pieces.length
    if pieces is not None:
        pieces.used += 1
    rank, nope, v_dim = m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim
    weight = absorbable_weight(m)
    dtype = compute_dtype(query.device, query.dtype)
    kernels = kernels_for(query.device, dtype, rank + m.qk_rope_head_dim)
    if weight is None or dropout > 0.0 or kernels is None or past == 0:
        return _expanded(query, latent, past, dropout, scale)
    b, h = query.shape[:2]
    w = weight.view(h, nope + v_dim, rank)
    q_latent = torch.matmul(query[..., :nope], w[:, :nope])  # [B, H, q, rank]
    q_abs = torch.cat([q_latent, query[..., nope:]], dim=-1)  # [B, H, q, rank + rope]
    kv_self = torch.cat([latent.latent, latent.rope], dim=-1)  # [B, 1, q, rank + rope]
    cs, rots = _coalesce(pieces.keys), _coalesce(pieces.values)
    out = _SplitAttention.apply(q_abs, kv_self, kv_self, scale, h, len(cs), kernels, dtype, True, *cs, *rots)
    return torch.matmul(out[..., :rank], w[:, nope:].transpose(-1, -2))  # [B, H, q, v]


def _expanded(query: torch.Tensor, latent: LatentKV, past: int, dropout: float, scale: float) -> torch.Tensor:
    """The model's own computation: ``expand_kv`` over the whole context, one masked sdpa call."""
    c, rot = latent.latent, latent.rope
    if past > 0:
        c_past, rot_past = latent.pieces.full(query.shape[0])
        c, rot = torch.cat([c_past, c], dim=-2), torch.cat([rot_past, rot], dim=-2)
    m = latent.module
    key, value = type(m).expand_kv(m, c, rot)  # [B, H, past + q, nope + rope], [B, H, past + q, v]
    return masked_attention(query, key, value, past, dropout, scale)
