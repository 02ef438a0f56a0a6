"""The plain computation the tree's MoE router load-balancing loss is compared with.

Shared by the router's exactness tests (``tests/core/test_router.py``, ``tests/core/test_cuda.py``)
and the GPU checks (``scripts/gpu/checks.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from .forests import deep_tree, grpo_group
from .models import dense_logprobs

__all__ = ["router_window", "stock_router_losses"]


def router_window() -> tuple[list[list[int]], list[int], list[int]]:
    """Two micro-batches: a GRPO group split across them (its prompt shared by both) and a deep tree.

    Returns:
        ``(seqs, score_from, rows)``: ``rows`` bounds the three groups (the first two share a prompt).
    """
    a, fa = grpo_group(seed=4)
    b, fb = deep_tree()
    seqs, sf = a + b, fa + fb
    return seqs, sf, [0, 3, len(a), len(seqs)]


def stock_router_losses(
    model: nn.Module,
    seqs: list[list[int]],
    sf: list[int],
    rows: list[int],
    weights: list[float],
    coefs: list[torch.Tensor],
) -> torch.Tensor:
    """Plain autograd: the per-sequence log-prob functional ``sum(lp * coef)`` plus each group's
    router aux loss (``weights[g]`` times the model's own ``aux_loss`` over group ``g``'s padded
    batch, left-padded as TRL's prompts), backpropagated.

    Args:
        rows: group bounds into ``seqs`` (``[0, ..., len(seqs)]``).
        weights: one aux-loss weight per group.
        coefs: per sequence, ``[len(seq) - sf]`` coefficients of its scored log-probs.

    Returns:
        ``[groups]``: each group's aux loss (detached).
    """
    lps, _ = dense_logprobs(model, seqs, sf)
    loss = sum((lp * c).sum() for lp, c in zip(lps, coefs, strict=True))
    values = []
    for g, w in enumerate(weights):
        part = seqs[rows[g] : rows[g + 1]]
        width = max(map(len, part))
        ids = torch.zeros(len(part), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(part):  # left padding, as TRL's prompts
            ids[b, width - len(s) :], mask[b, width - len(s) :] = torch.tensor(s), 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        dev = next(model.parameters()).device
        out = model(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=pos.to(dev),
            output_router_logits=True,
        )
        aux = out.aux_loss
        values.append(aux.detach())
        loss = loss + w * aux
    loss.backward()
    return torch.stack(values)
