"""``forkrl.tree_balance`` for veRL: one mini-batch's rows moved between data-parallel ranks by tree cost.

veRL's driver reorders each step's batch by sequence length (Karmarkar-Karp over the dp ranks)
and every rank trains its chunk mini-batch by mini-batch; length balancing spreads a GRPO group
over ranks, each of which then computes its shared prompt, and a rank holding the groups that
share the least still trains longest while the others wait at FSDP's reduce-scatter. At each
mini-batch (an optimizer step), before the tree step, every rank splits its mini-batch into rows,
:func:`forkrl.core.balance.rebalance` gathers them, plans over the dp group (groups kept whole;
a rank's row count may change: nothing in veRL's engine needs equal counts) and hands each rank
its share, and the rows are collated back into one
mini-batch in veRL's layout (nested fields re-nested; in the left-right padded layout prompts
left-padded and per-token fields right-padded to the widest row over the ranks).

The update is veRL's own: the mini-batch's rows are the same set over the dp group, and veRL's
loss normalises every term by mini-batch-global counts (``agg_loss`` with ``dp_size``,
``batch_num_tokens`` and ``global_batch_size``), so any regrouping of the rows gives the same
gradient, whichever rank holds how many of them (FSDP averages the ranks' gradients, and each
rank's loss is scaled by ``dp_size``). With a fixed micro-batch size, a rank whose new row count
is not the old one trains as many micro-batches as before, of nearly equal sizes (veRL's metrics
aggregate per micro-batch over the ranks; the grouping does not enter these losses). :func:`unsafe_reason` names the losses for which that does not hold;
when rows move at all is core's rule (:class:`~forkrl.core.balance.rules.BalanceOption`, here
:data:`OPTION`: ``auto`` leaves such rows in place, ``on`` refuses them). The per-micro-batch metrics
veRL averages (clip fractions, ``ppo_kl``) follow the new grouping; the logged loss does not change.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from forkrl.core.balance import BalanceOption, CostModel, Rebalanced, padded, prompt_response, rebalance

from . import compat
from .compat import ROW_LOCAL_LOSSES

__all__ = ["OPTION", "balance_mini_batch", "unsafe_reason"]

#: ``forkrl.tree_balance`` in veRL's words (core's rule of when rows may move).
OPTION = BalanceOption(
    on="forkrl.tree_balance: on",
    auto="forkrl.tree_balance: auto",
    off="forkrl.tree_balance: off",
    update="veRL's update",
)

#: Non-tensor fields derived from the batch's padded layout: recomputed for the new rows.
_LAYOUT_FIELDS = ("max_seq_len", "max_response_len", "indices")
#: Padded fields laid out ``[left-padded prompt | right-padded response]``, split at the prompt's width.
_LEFT_RIGHT = ("attention_mask", "input_ids", "position_ids")
_PROMPT_LEN = "_forkrl_prompt_len"


def unsafe_reason(loss_mode: str, loss_agg_mode: str, loss_scale_factor: Any) -> str | None:
    """Why moving a mini-batch's rows between ranks would change veRL's update (None: it would not)."""
    if loss_mode not in ROW_LOCAL_LOSSES:
        return (
            f"policy_loss.loss_mode={loss_mode!r} is not one forkrl knows to weight rows independently of their "
            f"micro-batch (clip_cov, kl_cov and geo_mean use micro-batch statistics; known: {list(ROW_LOCAL_LOSSES)})"
        )
    if loss_agg_mode == "seq-mean-token-sum-norm" and loss_scale_factor is None:
        return "loss_agg_mode='seq-mean-token-sum-norm' without loss_scale_factor divides by each micro-batch's width"
    return None


def _split(data: TensorDict) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per row, every per-row field (nested rows unbound, padded rows as they are); and the
    batch's non-tensor fields."""
    batch = int(data.batch_size[0])
    rows: list[dict[str, Any]] = [{} for _ in range(batch)]
    meta: dict[str, Any] = {}
    for key in list(data.keys()):
        value = data.get(key)
        if isinstance(value, NonTensorData):
            meta[key] = value.data
            continue
        if isinstance(value, NonTensorStack):
            parts = value.tolist()
        elif isinstance(value, torch.Tensor):
            parts = [v.detach().cpu().clone() for v in value.unbind(0)]
        else:
            raise ValueError(
                f"tree_balance: veRL batch field {key!r} is a {type(value).__name__}, which forkrl cannot move "
                "between ranks: set forkrl.tree_balance: off"
            )
        for row, part in zip(rows, parts, strict=True):
            row[key] = part
    for row, length in zip(rows, compat.prompt_lengths(data).tolist(), strict=True):
        row[_PROMPT_LEN] = int(length)
    return rows, meta


def _sequence(row: dict[str, Any]) -> tuple[list[int], int]:
    """The row's tokens (prompt then response) and where its scored part starts."""
    return row["input_ids"].tolist(), row[_PROMPT_LEN]


def _nested(template: torch.Tensor) -> bool:
    return bool(getattr(template, "is_nested", False))


def _padded(key: str, rows: list[dict[str, Any]], widths: dict[str, int]) -> torch.Tensor:
    """One padded field of ``rows`` at the widths over the ranks (``[B, widths[key], ...]``)."""
    parts = [r[key] for r in rows]
    if key in _LEFT_RIGHT and "prompts" in widths:  # [left-padded prompt | right-padded response]
        own = [r["prompts"].shape[0] for r in rows]
        return prompt_response(parts, own, widths["prompts"], widths["prompts"] + widths["responses"])
    return padded(parts, widths[key], left=key == "prompts")  # prompts left-padded, the rest right


def _collate(rows: list[dict[str, Any]], nested: dict[str, bool], widths: dict[str, int]) -> TensorDict:
    """veRL's layout for ``rows``: nested fields re-nested, padded ones padded to ``widths``."""
    out = TensorDict({}, batch_size=[len(rows)])
    for key in rows[0]:
        if key == _PROMPT_LEN:
            continue
        parts = [r[key] for r in rows]
        if not isinstance(parts[0], torch.Tensor):
            out[key] = NonTensorStack(*parts)
        elif nested[key]:
            out[key] = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
        elif key in widths:
            out[key] = _padded(key, rows, widths)
        else:  # one value per row
            out[key] = torch.stack(parts)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # values without a plain equality: compare their text
        return repr(a) == repr(b)


def balance_mini_batch(
    data: TensorDict, model: CostModel | None, group=None, min_rows: int = 1
) -> tuple[TensorDict, Rebalanced]:
    """This rank's mini-batch after rebalancing over the dp ``group``: the plan's rows, in veRL's
    layout, with the batch's non-tensor fields (layout-derived ones recomputed). Every rank of the
    group calls it at the same mini-batch. A field forkrl cannot move, or fields that differ between
    the ranks' mini-batches (other than the rows), raise on every rank before anything changed.

    Args:
        data: this rank's mini-batch, ``batch_size [B]`` (every rank the same ``B``).
        model: the cost model the plan prices trees with (None: tokens).
        group: the data-parallel process group.
        min_rows: the fewest rows a rank may get (one per micro-batch it trains).
    """
    import torch.distributed as dist

    rows, meta = _split(data)
    tensors = {k: data.get(k) for k in rows[0] if k != _PROMPT_LEN and isinstance(data.get(k), torch.Tensor)}
    nested = {k: _nested(v) for k, v in tensors.items()}
    widths = {k: int(v.shape[1]) for k, v in tensors.items() if not nested[k] and v.dim() > 1}
    shared = {k: v for k, v in meta.items() if k not in _LAYOUT_FIELDS}
    lengths = {k: int(meta[k]) for k in ("max_seq_len", "max_response_len") if k in meta}
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (nested, shared, widths, lengths), group=group)
    differ = sorted(
        {k for n, _, _, _ in gathered for k in set(n) | set(nested) if n.get(k) != nested.get(k)}
        | {k for _, m, _, _ in gathered for k in set(m) | set(shared) if not _same(m.get(k), shared.get(k))}
    )
    if differ:
        raise ValueError(
            f"tree_balance: the dp ranks' mini-batches differ in {differ} (beyond their rows), so rows cannot move "
            "between them: set forkrl.tree_balance: off"
        )
    result = rebalance(rows, _sequence, model, group=group, equal_rows=False, min_rows=min_rows)
    widths = {k: max(w[k] for _, _, w, _ in gathered) for k in widths}  # the widest over the ranks
    out = _collate(result.rows, nested, widths)
    for key, value in shared.items():
        out[key] = NonTensorData(value)
    if "prompts" in widths and "responses" in widths:  # padded layout: the new widths
        lengths = {
            "max_seq_len": widths["prompts"] + widths["responses"],
            "max_response_len": widths["responses"],
        }
    else:
        lengths = {k: max(lay[k] for *_, lay in gathered) for k in lengths}
    for key, value in lengths.items():
        if key in meta:
            out[key] = NonTensorData(value)
    if "indices" in meta:  # flash-attention unpadding indices of the padded layout
        if "attention_mask" not in widths:
            raise ValueError("tree_balance: the batch has unpadding 'indices' but no padded attention_mask")
        out["indices"] = NonTensorData(
            torch.nonzero(out["attention_mask"].flatten(), as_tuple=False).flatten()
        )
    return out, result
