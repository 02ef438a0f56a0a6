"""Packed mode: the whole forest as one sequence with a tree attention mask.

Exact for attention-only models (a recurrent or convolutional layer would mix sibling branches);
an oracle in tests and the layout a GPU tree-mask kernel (FlexAttention) takes.
"""

from __future__ import annotations

import torch

from ..attention import subtree_ends, tree_mask
from ..errors import UnsupportedModelError
from ..tree import PrefixForest
from .head import ScoredHead
from .model import ModelAdapter

__all__ = ["check_packed", "run_packed"]


def check_packed(adapter: ModelAdapter) -> None:
    """Raise :class:`UnsupportedModelError` for models a tree mask cannot run exactly."""
    name = adapter.name
    if adapter.has_state:
        raise UnsupportedModelError(
            f"{name} keeps convolution/recurrent state, which a tree attention mask cannot route: use "
            "mode='keep' or mode='replay'"
        )
    if "sliding" in adapter.layer_kinds:
        raise UnsupportedModelError(
            f"{name} has sliding-window layers; packed mode passes one tree mask to all layers: use mode='keep' "
            "or mode='replay'"
        )
    if adapter.attn_implementation not in ("sdpa", "eager", None):
        raise UnsupportedModelError(
            f"packed mode needs an attention implementation that accepts a 4D tree mask (sdpa or eager); {name} "
            f"uses {adapter.attn_implementation!r}: use mode='keep'"
        )


def run_packed(adapter: ModelAdapter, forest: PrefixForest, grad: bool, head: ScoredHead) -> None:
    """Score (or, with ``grad``, backpropagate through) every entry of ``forest`` in one forward."""
    device = adapter.head.weight.device
    nodes = forest.nodes
    offsets = [0]
    for n in nodes:
        offsets.append(offsets[-1] + len(n.tokens))
    ids = torch.cat([n.tokens for n in nodes]).to(device).unsqueeze(0)
    pos = torch.cat([torch.arange(n.start, n.end) for n in nodes]).to(device).unsqueeze(0)
    mask = tree_mask(subtree_ends([len(n.tokens) for n in nodes], [n.parent for n in nodes]).to(device))
    if adapter.attn_implementation == "eager":  # eager adds its mask
        dtype = adapter.head.weight.dtype
        attn = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)
    else:
        attn = mask
    rows = torch.cat([n.rows + offsets[n.index] for n in nodes])
    entry_row, base = [], 0
    for n in nodes:
        entry_row.append(n.entry_row + base)
        base += len(n.rows)
    entry_target = torch.cat([n.entry_target for n in nodes])
    with torch.set_grad_enabled(grad):
        hidden = adapter.hidden(ids, pos, cache=None, attention_mask=attn[None, None])[0]
        h_rows = hidden[rows.to(device)]
    out_rows, g = head.rows(
        h_rows, torch.cat(entry_row), torch.arange(forest.num_entries), entry_target, grad
    )
    if grad and out_rows is not None and out_rows.requires_grad:
        torch.autograd.backward([out_rows], [g])
