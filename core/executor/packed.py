"""Packed mode: the whole forest as one sequence with a tree attention mask.

Exact for attention-only models (a recurrent or convolutional layer would mix sibling branches);
an oracle in tests, and on CUDA the FlexAttention tree-mask path that keep mode is measured against.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..attention import subtree_ends, tree_mask
from ..errors import UnsupportedModelError
from ..tree import PrefixForest
from .head import ScoredHead
from .model import ModelAdapter
from .router import RouterLoss, RouterPass
from .staging import HeadRowsBuilder

__all__ = ["check_packed", "run_packed"]

logger = logging.getLogger(__name__)


def check_packed(adapter: ModelAdapter) -> None:
    """Raise :class:`UnsupportedModelError` for models a tree mask cannot run exactly."""
    name = adapter.name
    if adapter.has_state:
        raise UnsupportedModelError(
            f"{name} keeps convolution/recurrent state, which a tree attention mask cannot route: use "
            "mode='keep' or mode='replay'"
        )
    # GPT-Neo's local layers keep full cache layers and apply their window through the mask only.
    local = "local" in (getattr(adapter.config, "attention_layers", None) or ())
    if "sliding" in adapter.layer_kinds or local:
        raise UnsupportedModelError(
            f"{name} has sliding-window layers; packed mode passes one tree mask to all layers: use mode='keep' "
            "or mode='replay'"
        )
    if adapter.attn_implementation not in ("sdpa", "eager", None):
        raise UnsupportedModelError(
            f"packed mode needs an attention implementation that accepts a 4D tree mask (sdpa or eager); {name} "
            f"uses {adapter.attn_implementation!r}: use mode='keep'"
        )


# Set after a FlexAttention failure on a device: packed mode then uses the dense mask there.
_FLEX_FAILED: set[str] = set()


def _flex_block_mask(ends: torch.Tensor):
    """FlexAttention ``BlockMask`` of the tree mask (``mask_mod``: ``k <= q < subtree_end[k]``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, k):
        return (k <= q) & (q < ends[k])

    n = len(ends)
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=ends.device)


def _use_flex(device: torch.device) -> bool:
    """FlexAttention on CUDA (it has no backward on the CPU), unless it failed there before."""
    return device.type == "cuda" and str(device) not in _FLEX_FAILED


def _dense_mask(adapter: ModelAdapter, ends: torch.Tensor) -> torch.Tensor:
    mask = tree_mask(ends)
    if adapter.attn_implementation == "eager":  # eager adds its mask
        dtype = adapter.head.weight.dtype
        return torch.zeros(mask.shape, dtype=dtype, device=ends.device).masked_fill_(
            ~mask, torch.finfo(dtype).min
        )
    return mask


def run_packed(
    adapter: ModelAdapter,
    forest: PrefixForest,
    grad: bool,
    head: ScoredHead,
    router: RouterLoss | None = None,
) -> None:
    """Score (or, with ``grad``, backpropagate through) every entry of ``forest`` in one forward.

    With ``router`` (bound to ``forest``), the MoE router loss is counted from the same forward
    (scoring) and, with ``grad``, its surrogate joins the one backward.

    On CUDA the tree mask is a FlexAttention ``BlockMask`` (compiled kernels skip the masked
    blocks; the model's attention is switched to ``flex_attention`` for the pass); elsewhere, or
    after FlexAttention failed on the device (logged once), a dense ``[total, total]`` mask.
    """
    device = adapter.head.weight.device
    nodes = forest.nodes
    lengths = [len(n.tokens) for n in nodes]
    offsets = np.cumsum([0, *lengths])
    builder = HeadRowsBuilder()
    entry_row, base = [], 0
    for n in nodes:
        entry_row.append(n.entry_row.numpy() + base)
        base += len(n.rows)
    builder.add(
        np.concatenate([n.rows.numpy() + offsets[n.index] for n in nodes]),
        np.concatenate(entry_row),
        np.arange(forest.num_entries),
        np.concatenate([n.entry_target.numpy() for n in nodes]),
    )
    host = [
        np.concatenate([n.tokens.numpy() for n in nodes])[None],
        np.concatenate([np.arange(n.start, n.end) for n in nodes])[None],
        subtree_ends(lengths, [n.parent for n in nodes]).numpy(),
    ]
    (rows,), (ids, pos, ends) = builder.build(device, host)
    routers = [] if router is not None else None
    with torch.set_grad_enabled(grad):
        hidden = _forward(adapter, ids, pos, ends, routers)
        h_rows = rows.select(hidden)
        term = None
        if routers is not None:
            nodes_of = torch.cat([torch.full((len(n.tokens),), n.index) for n in nodes])
            if not grad or not router.counted:  # every token's top-k is in this forward
                RouterPass(router, count=True, device=device).record([r.detach() for r in routers], nodes_of)
            if grad:
                term = RouterPass(router, count=False, device=device).record(routers, nodes_of)
        del routers
    out_rows, g = head.rows(h_rows, rows, grad)
    outputs, grads = [], []
    if grad and out_rows is not None and out_rows.requires_grad:
        outputs, grads = [out_rows], [g]
    if term is not None and term.requires_grad:
        outputs.append(term)
        grads.append(torch.ones_like(term))
    if outputs:
        torch.autograd.backward(outputs, grads)


def _forward(
    adapter: ModelAdapter,
    ids: torch.Tensor,
    pos: torch.Tensor,
    ends: torch.Tensor,
    routers: list | None = None,
) -> torch.Tensor:
    """``[total, hidden]`` final hidden states of the packed forest under its tree mask."""
    device = ends.device
    if _use_flex(device):
        try:
            block_mask = _flex_block_mask(ends)
            with adapter.attention_implementation("flex_attention"):
                return adapter.hidden(ids, pos, cache=None, attention_mask=block_mask, routers=routers)[0]
        except (RuntimeError, ImportError, TypeError, ValueError) as err:  # compile or kernel failure
            _FLEX_FAILED.add(str(device))
            if routers is not None:
                routers.clear()
            logger.warning(
                "packed mode: FlexAttention failed on %s (%s); using a dense tree mask", device, err
            )
    mask = _dense_mask(adapter, ends)[None, None]
    return adapter.hidden(ids, pos, cache=None, attention_mask=mask, routers=routers)[0]
