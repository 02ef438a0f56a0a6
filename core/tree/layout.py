"""Host row layouts to and from per-sequence tokens and scored spans.

Hosts hold a micro-batch in their own layout; a :class:`~forkrl.core.tree.PrefixForest` wants each
row's real tokens and the index where its scored tokens begin. A :class:`RowLayout` records both
directions: the rows' tokens, and for every scored token (row by row, in position order) its flat
index in the host's per-token tensors (log-probs, entropies, masks). The layouts the three hosts use:

- :meth:`RowLayout.padded`: ``[B, T]`` rows whose real tokens are one run per row, per-token
  tensors over the last ``width`` columns. TRL's ``[left-padded prompt | right-padded completion]``
  with ``[B, C]`` completion tensors; OpenRLHF's sequences with ``[B, num_actions]`` action tensors
  (``response_mask`` = its action mask); veRL without remove-padding (``[B, response_len]``);
  right-padded full sequences with ``[B, T]`` (``width=T``) or ``[B, T - 1]`` next-token tensors.
- :meth:`RowLayout.packed`: rows concatenated into ``[total]`` (or ``(1, total)``) with cumulative
  lengths, per-token tensors in the same packed layout, aligned to the token or to the position
  that predicts the next one (veRL remove-padding and OpenRLHF packing roll their inputs so).
- :meth:`RowLayout.spans`: each row's scored tokens left-aligned in ``[B, max scored]`` (the core
  objective bridge's own layout).

:class:`Window` joins the micro-batches of one optimizer step: their rows, in order, are the
forest's sequences.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .forest import PrefixForest

__all__ = ["RowLayout", "Window"]


def _runs(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, (first column, count) of the ones, after checking they form one contiguous run."""
    mask = mask.bool()
    counts = mask.sum(-1)
    first = torch.where(counts > 0, mask.to(torch.int8).argmax(-1), torch.zeros_like(counts))
    cols = torch.arange(mask.shape[1], device=mask.device)
    expect = (cols >= first[:, None]) & (cols < (first + counts)[:, None])
    bad = (mask != expect).any(-1).nonzero().flatten()
    if len(bad):
        raise ValueError(
            f"row {int(bad[0])} of attention_mask is not one run of real tokens (padding inside the row): forkrl "
            "expects padding on the outside only, e.g. a left-padded prompt followed by a right-padded completion"
        )
    return first, counts


@dataclass
class RowLayout:
    """One host micro-batch as per-row tokens and scored spans, and the map to the host's tensors.

    Attributes:
        sequences: one ``[n_b]`` int64 CPU tensor per row: its real tokens.
        score_from: per row, the index in ``sequences[b]`` of its first scored token
            (``n_b`` when it scores nothing).
        shape: the shape of the host's per-token tensors for this micro-batch.
        index: ``[N]`` flat index into a tensor of ``shape`` of every scored token, row by row in
            position order (``N = sum(n_b - score_from_b)``).
    """

    sequences: list[torch.Tensor]
    score_from: list[int]
    shape: tuple[int, ...]
    index: torch.Tensor

    # ------------------------------------------------------------------ constructors
    @classmethod
    def padded(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        width: int,
        response_mask: torch.Tensor | None = None,
    ) -> RowLayout:
        """Padded rows; per-token tensors ``[B, width]`` over the last ``width`` columns.

        Args:
            input_ids: ``[B, T]`` token ids.
            attention_mask: ``[B, T]``, 1 at real tokens, which form one run per row.
            width: columns of the per-token tensors; column ``j`` holds the value of the token at
                column ``T - width + j``.
            response_mask: ``[B, width]``: a row's scored tokens start at its first 1 and run to its
                last real token (holes, e.g. tool output, are scored too and masked by the host's
                loss). None: every real token in the last ``width`` columns is scored.

        Raises:
            ValueError: on mismatched shapes, padding inside a row, a scored token without a real
                token before it, or a response mask marking padding.
        """
        if input_ids.dim() != 2 or tuple(input_ids.shape) != tuple(attention_mask.shape):
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must have the "
                "same [batch, time] shape"
            )
        total = input_ids.shape[1]
        if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= total:
            raise ValueError(
                f"width={width!r} must be an integer in [1, {total}] for rows of {total} columns"
            )
        first, counts = _runs(attention_mask.detach().cpu())
        region = total - width
        # First scored column of each row (absolute), before checking it.
        if response_mask is None:
            scored_col = torch.maximum(first, torch.full_like(first, region))
        else:
            if tuple(response_mask.shape) != (len(first), width):
                raise ValueError(
                    f"response_mask must have the per-token shape [{len(first)}, {width}], got {tuple(response_mask.shape)}"
                )
            scored_col = cls._response_start(response_mask, first, counts, region)
        end = first + counts
        scored_col = torch.minimum(scored_col, end)
        no_context = ((scored_col <= first) & (scored_col < end)).nonzero().flatten()
        if len(no_context):
            raise ValueError(
                f"row {int(no_context[0])} has no prompt token before its first scored token: a first token has no "
                "context to be predicted from; give every rollout a non-empty prompt"
            )
        ids = input_ids.detach().cpu().to(torch.long)
        fs, ns, ss = first.tolist(), counts.tolist(), scored_col.tolist()
        sequences = [ids[b, fs[b] : fs[b] + ns[b]] for b in range(len(ids))]
        index = [b * width + torch.arange(ss[b], fs[b] + ns[b]) - region for b in range(len(ids))]
        return cls(sequences, [s - f for s, f in zip(ss, fs, strict=True)], (len(ids), width), _cat(index))

    @staticmethod
    def _response_start(response_mask, first, counts, region) -> torch.Tensor:
        """Absolute column of each row's first response token (its real end when it has none)."""
        rm = response_mask.detach().cpu().bool()
        cols = torch.arange(rm.shape[1]) + region
        outside = rm & ((cols[None, :] < first[:, None]) | (cols[None, :] >= (first + counts)[:, None]))
        bad = outside.any(-1).nonzero().flatten()
        if len(bad):
            raise ValueError(
                f"row {int(bad[0])} of response_mask marks a padding position: it must mark real tokens only"
            )
        return torch.where(rm.any(-1), rm.to(torch.int8).argmax(-1) + region, first + counts)

    @classmethod
    def packed(
        cls,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | Sequence[int],
        score_from: torch.Tensor | Sequence[int],
        align: str = "token",
    ) -> RowLayout:
        """Rows packed end to end; per-token tensors in the same packed layout.

        Args:
            input_ids: ``[total]`` or ``(1, total)`` token ids of all rows, concatenated.
            cu_seqlens: ``[B + 1]`` cumulative row lengths, from 0 to ``total``.
            score_from: ``[B]`` index within each row of its first scored token (its prompt length).
            align: ``"token"``: the value of token ``t`` sits at ``t``; ``"next"``: at ``t - 1``, the
                position that predicts it (inputs rolled by one, as veRL and OpenRLHF do).
        """
        if align not in ("token", "next"):
            raise ValueError(f"align={align!r} must be 'token' or 'next'")
        shape = tuple(input_ids.shape)
        flat = input_ids.detach().cpu().reshape(-1).to(torch.long)
        if len(shape) not in (1, 2) or (len(shape) == 2 and shape[0] != 1):
            raise ValueError(f"packed input_ids must be [total] or (1, total), got {shape}")
        cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != len(flat) or any(b <= a for a, b in itertools.pairwise(cu)):
            raise ValueError(
                f"cu_seqlens must rise strictly from 0 to the packed length {len(flat)}, got {cu[:8]}"
                + ("..." if len(cu) > 8 else "")
            )
        sf = [int(s) for s in (score_from.tolist() if isinstance(score_from, torch.Tensor) else score_from)]
        if len(sf) != len(cu) - 1:
            raise ValueError(f"score_from has {len(sf)} entries for {len(cu) - 1} packed rows")
        shift = 1 if align == "next" else 0
        sequences, index = [], []
        for b, (a, e) in enumerate(itertools.pairwise(cu)):
            if not 1 <= sf[b] <= e - a:
                raise ValueError(
                    f"score_from[{b}] = {sf[b]} is out of range for packed row {b} of length {e - a}: it must satisfy "
                    "1 <= score_from <= length"
                )
            sequences.append(flat[a:e])
            index.append(torch.arange(a + sf[b], e) - shift)
        return cls(sequences, sf, shape, _cat(index))

    @classmethod
    def spans(cls, sequences: Sequence[torch.Tensor], score_from: Sequence[int]) -> RowLayout:
        """Each row's scored tokens left-aligned in ``[B, max(1, longest scored span)]``."""
        seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
        scored = [len(s) - int(f) for s, f in zip(seqs, score_from, strict=True)]
        width = max(1, max(scored, default=0))
        index = [b * width + torch.arange(n) for b, n in enumerate(scored)]
        return cls(seqs, [int(f) for f in score_from], (len(seqs), width), _cat(index))

    # ------------------------------------------------------------------ maps
    @property
    def scored(self) -> list[int]:
        """Scored tokens per row."""
        return [len(s) - f for s, f in zip(self.sequences, self.score_from, strict=True)]

    @property
    def num_scored(self) -> int:
        return int(self.index.numel())

    def to_host(self, values: torch.Tensor, fill: float | torch.Tensor = 0.0) -> torch.Tensor:
        """``[N]`` values (row by row) into a tensor of ``shape``; other slots ``fill``.

        Differentiable in ``values`` (and in a tensor ``fill``), on ``values``' device and dtype.
        """
        self._check(values, "values")
        if isinstance(fill, torch.Tensor):
            base = fill.to(device=values.device, dtype=values.dtype).reshape(-1)
        else:
            base = values.new_full((_numel(self.shape),), fill)
        return base.index_put((self.index.to(values.device),), values).reshape(self.shape)

    def from_host(self, host: torch.Tensor) -> torch.Tensor:
        """The ``[N]`` scored slots of a host tensor of ``shape``, row by row."""
        if tuple(host.shape) != self.shape:
            raise ValueError(f"expected a host tensor of shape {self.shape}, got {tuple(host.shape)}")
        return host.reshape(-1)[self.index.to(host.device)]

    def mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Boolean tensor of ``shape``, True at scored slots."""
        out = torch.zeros(_numel(self.shape), dtype=torch.bool, device=device)
        out[self.index.to(out.device)] = True
        return out.reshape(self.shape)

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """``[N]`` values into one ``[n_b - score_from_b]`` tensor per row."""
        self._check(values, "values")
        return list(torch.split(values, self.scored))

    def _check(self, values: torch.Tensor, name: str) -> None:
        if values.dim() != 1 or values.numel() != self.num_scored:
            raise ValueError(
                f"{name} must be a flat tensor of the {self.num_scored} scored tokens, got shape {tuple(values.shape)}"
            )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts).to(torch.long) if parts else torch.zeros(0, dtype=torch.long)


class Window:
    """The micro-batches of one optimizer step; their rows, in order, are the forest's sequences.

    Args:
        layouts: one :class:`RowLayout` per host micro-batch.
    """

    def __init__(self, layouts: Sequence[RowLayout]) -> None:
        if not layouts:
            raise ValueError("a window needs at least one micro-batch")
        self.layouts = list(layouts)
        self.sequences = [s for lay in self.layouts for s in lay.sequences]
        self.score_from = [f for lay in self.layouts for f in lay.score_from]
        self.rows = [0]
        for lay in self.layouts:
            self.rows.append(self.rows[-1] + len(lay.sequences))

    def __len__(self) -> int:
        return len(self.layouts)

    def forest(self) -> PrefixForest:
        """The prefix forest of every row of the window."""
        return PrefixForest.build(self.sequences, self.score_from)

    def flat(self, per_sequence: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-sequence values (the forest's order) into one flat ``[N_i]`` tensor per micro-batch."""
        out = []
        for i in range(len(self.layouts)):
            part = per_sequence[self.rows[i] : self.rows[i + 1]]
            out.append(torch.cat(list(part)) if len(part) else torch.zeros(0))
        return out

    def per_sequence(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The inverse of :meth:`flat`."""
        return [t for lay, f in zip(self.layouts, flat, strict=True) for t in lay.split(f)]
