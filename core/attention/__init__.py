"""Attention backends for tree passes, behind one selector.

- :mod:`.split`: the CPU split attention (a node over its ancestors' cache pieces, no mask),
  torch's CPU flash kernels merged by log-sum-exp.
- :mod:`.mask`: the packed tree mask, from one ``subtree_end`` per token.
- The model's own attention (sdpa/eager with an explicit mask) everywhere else; CUDA kernels
  called with their log-sum-exp are the next backend to add here.
"""

from __future__ import annotations

import torch

from .. import compat
from .mask import subtree_ends, tree_mask
from .split import MIN_PIECE, MIN_SPLIT_ELEMENTS, NAME, PastPieces, split_attention

__all__ = [
    "MIN_PIECE",
    "MIN_SPLIT_ELEMENTS",
    "NAME",
    "PastPieces",
    "select",
    "split_attention",
    "subtree_ends",
    "tree_mask",
]

_registered = False


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
        layer_kinds: per layer ``"full"``, ``"sliding"`` or ``"state"``.
        config: the text config (for attention logit softcapping).
        device: where the model runs.
        enabled: False forces the model's own attention.
    """
    ok = (
        enabled
        and device.type == "cpu"
        and attn_implementation == "sdpa"
        and all(k in ("full", "state") for k in layer_kinds)
        and getattr(config, "attn_logit_softcapping", None) is None
    )
    if not ok:
        return None
    global _registered
    if not _registered:  # at first use, never at import
        compat.register_attention(NAME, split_attention)
        _registered = True
    return NAME
