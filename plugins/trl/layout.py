"""TRL's padded batch layout to and from forkrl's per-sequence layout.

TRL holds a batch as ``[left-padded prompt | right-padded completion]`` with an attention mask,
and per-token tensors (log-probs, entropies, masks) as ``[B, C]`` aligned to the completion
columns. A :class:`~forkrl.core.tree.PrefixForest` takes each row's real tokens and the index
where its completion starts. Host-free: only torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["RowLayout", "from_padded", "gather_rows", "scatter_rows"]


@dataclass
class RowLayout:
    """The real tokens of a padded batch.

    Attributes:
        sequences: one ``[n_b]`` tensor per row: the prompt's real tokens then the completion's.
        score_from: per row, the index in ``sequences[b]`` of the first completion token.
        scored: per row, the number of real completion tokens (``n_b - score_from[b]``).
        width: ``C``, the completion columns of the padded layout.
    """

    sequences: list[torch.Tensor]
    score_from: list[int]
    scored: list[int]
    width: int


def _check_runs(mask: torch.Tensor, left: bool, what: str) -> torch.Tensor:
    """Per-row count of ones, after checking the ones form one block at the ``left``/right end."""
    counts = mask.sum(-1)
    cols = torch.arange(mask.shape[1], device=mask.device)
    expect = cols >= (mask.shape[1] - counts)[:, None] if left else cols < counts[:, None]
    bad = (mask.bool() != expect).any(-1).nonzero().flatten()
    if len(bad):
        side = "left" if left else "right"
        raise ValueError(
            f"row {int(bad[0])} of the {what} mask is not {side}-padded (its ones are not one block at the "
            f"{'end' if left else 'start'}): forkrl's tree path expects TRL's layout, a left-padded prompt and a "
            "right-padded completion"
        )
    return counts


def from_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> RowLayout:
    """Split ``[B, P + C]`` TRL inputs into per-row token sequences.

    Args:
        input_ids: ``[B, P + C]`` prompt (left-padded) then completion (right-padded) token ids.
        attention_mask: ``[B, P + C]`` 1 for real tokens.
        logits_to_keep: ``C``, the completion width.

    Raises:
        ValueError: on mismatched shapes, a row with no prompt token, or a mask that is not TRL's
            left/right padding.
    """
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must be the same "
            "[batch, time] shape"
        )
    width = int(logits_to_keep)
    total = input_ids.shape[1]
    if not 1 <= width < total:
        raise ValueError(f"logits_to_keep={width} must be in [1, {total - 1}] for inputs of width {total}")
    split = total - width
    prompt_counts = _check_runs(attention_mask[:, :split], left=True, what="prompt")
    comp_counts = _check_runs(attention_mask[:, split:], left=False, what="completion")
    empty = (prompt_counts == 0).nonzero().flatten()
    if len(empty):
        raise ValueError(
            f"row {int(empty[0])} has no prompt token: a first token has no context to be predicted from; "
            "give every rollout a non-empty prompt"
        )
    ids = input_ids.detach().cpu()
    pc, cc = prompt_counts.tolist(), comp_counts.tolist()
    sequences = [
        torch.cat([ids[b, split - pc[b] : split], ids[b, split : split + cc[b]]]) for b in range(len(ids))
    ]
    return RowLayout(sequences=sequences, score_from=pc, scored=cc, width=width)


def scatter_rows(
    values: Sequence[torch.Tensor], width: int, fill: float = 0.0, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Per-row ``[n_b]`` values into a ``[B, width]`` tensor, left-aligned; other slots ``fill``."""
    device = values[0].device if len(values) else torch.device("cpu")
    dtype = dtype or (values[0].dtype if len(values) else torch.float32)
    out = torch.full((len(values), width), fill, dtype=dtype, device=device)
    for b, v in enumerate(values):
        out[b, : len(v)] = v
    return out


def gather_rows(padded: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """``[B, C]`` back to per-row ``[n_b]`` tensors (the first ``n_b`` columns)."""
    return [padded[b, :n] for b, n in enumerate(lengths)]
