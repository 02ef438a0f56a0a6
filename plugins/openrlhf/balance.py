"""``--forkrl.tree_balance`` for OpenRLHF: one optimizer step's rows moved between data-parallel ranks by tree cost.

Each rank's replay buffer holds its share of the rollouts, shuffled; a rank whose window holds the
long prompts (or shares the least) trains longest while the others wait at DeepSpeed's reduction.
At a window's first micro-batch, before the tree step, each rank splits its window's micro-batches
into rows, :func:`forkrl.core.balance.rebalance` gathers them, plans (groups kept whole; a rank's
row count may change) and hands each rank its share, and the rows are collated back into as many
micro-batches as the rank had (every rank issues DeepSpeed's per-micro-batch steps in lockstep),
of nearly equal sizes, in OpenRLHF's layout (``[left-padded prompt | right-padded response]``, per-token
fields over the last ``num_actions`` columns).

The update is OpenRLHF's own: with fixed micro-batches every loss term (``PolicyLoss``, KL,
entropy, through ``aggregate_loss``) is a per-row sum over the window's global token or sequence
count, the same on every rank and for any grouping of the window's rows, whichever rank holds how
many of them. Refused (``on``) or left
alone (``auto``): the MoE router loss (a mean over each micro-batch) and dynamic batching (windows
of different lengths per rank); see :func:`forkrl.plugins.openrlhf.options.balance_setting`. The logged ``policy_loss`` and ``entropy_loss`` are per-micro-batch
values weighted by their token counts, so they follow the new grouping; per-row figures (reward,
lengths, clip ratios) do not change.
"""

from __future__ import annotations

from typing import Any

import torch
from openrlhf.trainer.ppo_utils.experience import Experience

from forkrl.core.balance import CostModel, Rebalanced, padded, prompt_response, rebalance

__all__ = ["balance_window"]

# Experience fields that hold the [left-padded prompt | right-padded response] token rows.
_TOKEN_ROWS = ("sequences", "attention_mask")


def _split(label: str, value: Any, batch: int) -> list[Any]:
    """``value`` (a per-row tensor or list) as one entry per row."""
    if not isinstance(value, (torch.Tensor, list)) or len(value) != batch:
        raise ValueError(
            f"tree_balance: experience.{label} is not per row ({type(value).__name__}); set --forkrl.tree_balance off"
        )
    return [v.detach().cpu() if isinstance(v, torch.Tensor) else v for v in value]


def _rows(experience: Experience) -> list[dict[str, Any]]:
    """One record per row: every per-row field, the prompt without its left padding."""
    batch = len(experience.sequences)
    width = experience.sequences.shape[1] - experience.action_mask.shape[1]  # prompt columns
    rows: list[dict[str, Any]] = [{"info": {}} for _ in range(batch)]
    for name in Experience.__dataclass_fields__:
        value = getattr(experience, name)
        if value is None or name == "index" or (isinstance(value, list) and not value):
            continue
        if isinstance(value, dict):
            for key, v in value.items():
                for row, part in zip(rows, _split(f"info[{key!r}]", v, batch), strict=True):
                    row["info"][key] = part
            continue
        for row, part in zip(rows, _split(name, value, batch), strict=True):
            row[name] = part
    for row in rows:
        real = row["attention_mask"][:width].nonzero()
        first = int(real[0]) if len(real) else width
        row["prompt_columns"] = width - first
        for name in _TOKEN_ROWS:
            row[name] = row[name][first:]
    return rows


def _sequence(row: dict[str, Any]) -> tuple[list[int], int]:
    keep = row["attention_mask"].bool()
    tokens = row["sequences"][keep].tolist()
    return tokens, int(keep[: row["prompt_columns"]].sum())


def _collate(rows: list[dict[str, Any]], device) -> Experience:
    """OpenRLHF's layout for ``rows``: prompts left-padded to the widest, responses and every
    per-token field right-padded to the longest response."""
    width = max(r["prompt_columns"] for r in rows)
    actions = max(r["action_mask"].shape[0] for r in rows)
    fields: dict[str, Any] = {}
    for name in rows[0]:
        if name in ("info", "prompt_columns"):
            continue
        parts = [r[name] for r in rows]
        if not isinstance(parts[0], torch.Tensor):
            fields[name] = parts
        elif name in _TOKEN_ROWS:
            own = [r["prompt_columns"] for r in rows]
            fields[name] = prompt_response(parts, own, width, width + actions).to(device)
        elif parts[0].dim() == 0:
            fields[name] = torch.stack(parts).to(device)
        else:
            fields[name] = padded(parts, actions).to(device)
    info = {}
    for key in rows[0]["info"]:
        vals = [r["info"][key] for r in rows]
        info[key] = torch.stack(vals).to(device) if isinstance(vals[0], torch.Tensor) else vals
    return Experience(**fields, info=info)


def balance_window(
    window: list[tuple[Experience, Any]], device, model: CostModel | None = None
) -> tuple[list[tuple[Experience, Any]], Rebalanced]:
    """This rank's window after rebalancing: as many micro-batches as before, of nearly equal sizes,
    each with its original loss normalisers (the window's global counts), filled with the rows the
    plan gives this rank (priced by ``model``; a rank's row count may change, down to one row per
    micro-batch). Every rank calls it at the same window."""
    rows = [row for e, _ in window for row in _rows(e)]
    result = rebalance(rows, _sequence, model, equal_rows=False, min_rows=len(window))
    n, k = len(result.rows), len(window)
    bounds = [n * i // k for i in range(k + 1)]
    out = [
        (_collate(result.rows[a:b], device), info)
        for (_, info), a, b in zip(window, bounds, bounds[1:], strict=False)
    ]
    return out, result
