"""What a pass indexes with, built on the host and moved to the device once.

Every index a pass needs (each unit's tokens, the rows its LM head reads, the entries those rows
score) is known from the forest before the pass starts. Built per unit and moved per unit, each
would be a host-to-device copy from pageable memory, which CUDA serialises with the stream: the
host waits for the device to drain, dozens of times per step. Here they are concatenated on the
host into one int64 buffer, pinned, copied once without blocking, and split into views; chunk
boundaries stay host integers, so nothing in the pass reads a device value back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..tree.forest import to_device

__all__ = ["HeadRows", "HeadRowsBuilder", "padded_batch"]


@dataclass
class HeadRows:
    """The LM head's work at one forward: which positions of its ``[n, hidden]`` output (flattened
    batch rows) it reads and which entries each scores.

    Attributes:
        rows: ``[R]`` device index into the flattened positions, or a ``slice`` where they are
            contiguous (a view instead of a gather).
        entry_row: ``[E]`` device index into the ``R`` rows (non-decreasing).
        entry_ids: ``[E]`` device global entry ids; ``entry_target``: ``[E]`` device target tokens.
        row_entries: ``[R + 1]`` host: the entries of row ``r`` are ``row_entries[r]:row_entries[r + 1]``.
    """

    rows: torch.Tensor | slice
    entry_row: torch.Tensor
    entry_ids: torch.Tensor
    entry_target: torch.Tensor
    row_entries: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.row_entries) - 1

    def select(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, hidden]`` rows of ``hidden`` (``[n, hidden]``)."""
        return hidden[self.rows] if isinstance(self.rows, slice) else hidden.index_select(0, self.rows)


class HeadRowsBuilder:
    """Collects the host arrays of many :class:`HeadRows`, then moves them all with one copy."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.pending: list[tuple[int, np.ndarray, slice | None]] = []  # (first array, row_entries, span)

    def add(
        self, rows: np.ndarray, entry_row: np.ndarray, entry_ids: np.ndarray, entry_target: np.ndarray
    ) -> int:
        """Queue one :class:`HeadRows` (host arrays); returns its handle for :meth:`build`."""
        rows = np.asarray(rows, dtype=np.int64)
        span = None
        if len(rows) and rows[-1] - rows[0] + 1 == len(rows):  # sorted and distinct: contiguous
            span = slice(int(rows[0]), int(rows[-1]) + 1)
        first = len(self.arrays)
        self.arrays += [rows if span is None else np.zeros(0, np.int64), entry_row, entry_ids, entry_target]
        entry_row = np.asarray(entry_row)
        self.pending.append((first, np.searchsorted(entry_row, np.arange(len(rows) + 1)), span))
        return len(self.pending) - 1

    def build(
        self, device: torch.device, extra: list[np.ndarray] = ()
    ) -> tuple[list[HeadRows], list[torch.Tensor]]:
        """Every queued :class:`HeadRows` and the ``extra`` arrays, on ``device`` (one copy)."""
        moved = to_device(self.arrays + list(extra), device)
        heads = []
        for first, row_entries, span in self.pending:
            rows, entry_row, entry_ids, entry_target = moved[first : first + 4]
            heads.append(
                HeadRows(span if span is not None else rows, entry_row, entry_ids, entry_target, row_entries)
            )
        return heads, moved[len(self.arrays) :]


def padded_batch(units: list, width: int | None = None) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Host arrays of ``units`` (:class:`forkrl.core.tree.Unit`) run as one right-padded batch.

    Returns:
        ``[N, W]`` token ids (zeros after each unit's end; ``W`` the longest unit, or ``width``), and
        the batch's head rows as :meth:`HeadRowsBuilder.add` takes them: positions in the
        flattened ``[N * W]`` batch, then each entry's row, id and target.
    """
    width = width or max(len(u.tokens) for u in units)
    ids = np.zeros((len(units), width), dtype=np.int64)
    rows, entry_row, base = [], [], 0
    for j, u in enumerate(units):
        ids[j, : len(u.tokens)] = u.tokens.numpy()
        rows.append(u.rows.numpy() + j * width)
        entry_row.append(u.entry_row.numpy() + base)
        base += len(u.rows)
    head = (
        np.concatenate(rows),
        np.concatenate(entry_row),
        np.concatenate([u.entry_ids.numpy() for u in units]),
        np.concatenate([u.entry_target.numpy() for u in units]),
    )
    return ids, head
