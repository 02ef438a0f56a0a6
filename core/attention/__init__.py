"""Attention backends for tree passes, behind one selector.

- :mod:`.split`: the split attention (a node over its ancestors' cache pieces, no mask), flash
  kernels merged by log-sum-exp: torch's CPU flash kernels; on CUDA the flash kernels for bf16/fp16
  (:func:`kernels_for`, self-checked on the device at first use).
- :mod:`.level`: a level run's attention (the units at one depth of many trees, each over its own
  ancestors), one kernel call per part whatever the number of trees.
- :mod:`.latent`: multi-head latent attention (DeepSeek-V2/V3's MLA) split over the latent cache,
  the up-projection absorbed into the queries (:func:`deferred_expand` defers the model's expansion).
- :mod:`.mask`: the packed tree mask, from one ``subtree_end`` per token.
- The model's own attention (sdpa/eager with an explicit mask) everywhere else, and where a kernel
  is missing or its self-check fails (float32 on CUDA, head dim > 256).
"""

from __future__ import annotations

import torch

from .. import compat
from .latent import deferred_expand
from .level import tree_attention
from .mask import subtree_ends, tree_mask
from .split import (
    MIN_PIECE,
    MIN_SPLIT_ELEMENTS,
    NAME,
    PastPieces,
    compute_dtype,
    kernels_for,
    split_attention,
)

__all__ = [
    "MIN_PIECE",
    "MIN_SPLIT_ELEMENTS",
    "NAME",
    "PastPieces",
    "compute_dtype",
    "deferred_expand",
    "kernels_for",
    "select",
    "split_attention",
    "subtree_ends",
    "tree_mask",
]

_registered = False

# Attention implementations whose layers compute plain softmax attention, which the split then
# replaces inside tree passes (a model loaded with flash-attention trains its tree the same way).
CUDA_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3")


def select(
    attn_implementation: str | None,
    layer_kinds: list[str],
    config,
    device: torch.device,
    enabled: bool = True,
) -> str | None:
    """The attention implementation a depth-first tree pass uses, or None for the model's own.

    Args:
        attn_implementation: the model's (``"sdpa"``, ``"eager"``, ...).
        layer_kinds: per layer ``"full"``, ``"sliding"``, ``"state"`` or ``"none"``.
        config: the text config (for attention logit softcapping).
        device: where the model runs.
        enabled: False forces the model's own attention.
    """
    cuda = device.type == "cuda" and compat.has_flash_cuda()
    ok = (
        enabled
        and (device.type == "cpu" or cuda)
        and (attn_implementation == "sdpa" or (cuda and attn_implementation in CUDA_IMPLEMENTATIONS))
        and all(k in ("full", "state", "none") for k in layer_kinds)
        and getattr(config, "attn_logit_softcapping", None) is None
    )
    if not ok:
        return None
    global _registered
    if not _registered:  # at first use, never at import
        compat.register_attention(NAME, tree_attention)
        _registered = True
    return NAME
