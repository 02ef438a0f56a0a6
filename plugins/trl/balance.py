"""``tree_balance`` for TRL: one optimizer step's rows moved between data-parallel ranks by tree cost.

TRL splits each generation batch over the processes in order, so a process can hold the groups
with the long prompts while another holds short ones, and every process waits for the slowest at
the gradient all-reduce. At the optimizer step's last micro-batch, before the tree step, each rank
turns its window's micro-batches into rows (every per-row tensor of TRL's prepared inputs),
:func:`forkrl.core.balance.rebalance` gathers them, plans (groups kept whole, equal rows per rank)
and hands each rank its share, and the rows are collated back into micro-batches of the original
sizes (prompts left-padded, per-token tensors right-padded to the widest row).

The update is TRL's own wherever the loss weights rows independently of who shares their
micro-batch: per-sequence means over a fixed number of rows (grpo, dr_grpo, sapo, luspo, RLOO) or
the step's global token count (dapo, cispo, vespo). Losses normalised by a micro-batch's own token
count (bnpo), the entropy bonus (a micro-batch token mean) and the entropy-quantile mask (a
micro-batch quantile) depend on the composition: ``tree_balance='auto'`` leaves the rows in place
for them, ``'on'`` refuses them.
"""

from __future__ import annotations

from typing import Any

import torch

from forkrl.core.balance import CostModel, Rebalanced, rebalance
from forkrl.core.balance.exchange import padded
from forkrl.core.balance.rules import ENTROPY_BONUS, ROUTER_LOSS

from . import compat

__all__ = ["balance_window", "unsafe_reason"]

# Loss types whose rows are weighted independently of the micro-batch they share.
_ROW_LOCAL = ("grpo", "dr_grpo", "sapo", "luspo", "dapo", "cispo", "vespo")
_LEFT_PADDED = ("prompt_ids", "prompt_mask")


def unsafe_reason(trainer: Any) -> str | None:
    """Why moving rows would change this trainer's update (None: it would not)."""
    if not trainer._own_loss():
        return "the trainer's loss is a subclass override, which may depend on the micro-batch's composition"
    loss_type = getattr(trainer, "loss_type", None)
    if loss_type is not None and loss_type not in _ROW_LOCAL:
        return f"loss_type={loss_type!r} normalises each micro-batch by its own token count"
    if compat.entropy_bonus_enabled(trainer):
        return ENTROPY_BONUS
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        return "top_entropy_quantile < 1 masks by a quantile over each micro-batch"
    if getattr(trainer, "aux_loss_enabled", False):
        return ROUTER_LOSS
    return None


def _rows(window: list[tuple[dict, Any]]) -> list[dict[str, torch.Tensor]]:
    rows = []
    for inputs, _ in window:
        batch = inputs["completion_ids"].shape[0]
        per_row = {
            k: v for k, v in inputs.items() if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == batch
        }
        for b in range(batch):
            row = {k: v[b].detach().cpu() for k, v in per_row.items()}
            keep = row["prompt_mask"].nonzero()
            first = int(keep[0]) if len(keep) else len(row["prompt_mask"])
            for k in _LEFT_PADDED:  # drop the left padding; collation pads to the new micro-batch
                row[k] = row[k][first:]
            rows.append(row)
    return rows


def _sequence(row: dict[str, torch.Tensor]) -> tuple[list[int], int]:
    prompt = row["prompt_ids"][row["prompt_mask"].bool()].tolist()
    completion = row["completion_ids"][row["completion_mask"].bool()].tolist()
    return prompt + completion, len(prompt)


def _collate(rows: list[dict[str, torch.Tensor]], pad_id: int, device) -> dict[str, torch.Tensor]:
    out = {}
    for key in rows[0]:
        parts = [r[key] for r in rows]
        if parts[0].dim() == 0:
            out[key] = torch.stack(parts)
            continue
        fill = pad_id if key in ("prompt_ids", "completion_ids") else 0
        width = max(p.shape[0] for p in parts)
        out[key] = padded(parts, width, left=key in _LEFT_PADDED, fill=fill).to(device)
    return out


def balance_window(
    window: list[tuple[dict, Any]], pad_id: int, device, model: CostModel | None = None
) -> tuple[list[tuple[dict, Any]], Rebalanced]:
    """This rank's window after rebalancing: micro-batches of the original sizes, each keeping its
    own non-row entries (``num_items_in_batch``, ...), filled with the rows the plan gives this rank
    (priced by ``model``: the trainer's cost model fitted to its steps so far)."""
    result = rebalance(_rows(window), _sequence, model)
    out, start = [], 0
    for inputs, num_items in window:
        size = inputs["completion_ids"].shape[0]
        mine = _collate(result.rows[start : start + size], pad_id, device)
        start += size
        out.append(({**inputs, **mine}, num_items))
    return out, result
