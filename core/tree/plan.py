"""The execution plan of a forest: its nodes cut into units of at most ``block_size`` tokens.

A unit is what the executor forwards at once: a whole forest node, or (replay mode, long-context
replay) one block of it. Units keep the forest's depth-first pre-order; the blocks of one node
form a chain, each the parent of the next.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from .forest import PrefixForest

__all__ = ["Unit", "collapsed", "plan"]


@dataclass(eq=False)
class Unit:
    """A unit of execution: a forest node, or one block of it.

    Index fields are host tensors (views of host arrays: building them issues no tensor op, so a
    plan costs the device nothing; the executor moves what a pass needs at once, :mod:`.staging`).

    Attributes:
        tokens: ``[n]`` token ids.
        start: absolute position of the first token.
        parent: index of the parent unit, -1 for a root.
        children: indices of the child units.
        rows: ``[R]`` sorted offsets whose hidden states feed the LM head.
        entry_row: ``[E]`` index into ``rows`` per entry (non-decreasing).
        entry_ids: ``[E]`` global entry ids.
        entry_target: ``[E]`` target tokens.
        context_only: no token of the unit is scored by any sequence (a prompt block).
        node: index of the forest node the unit is (a block of).
        offset: position of the unit's first token inside that node.
        node_len: length of that node.
    """

    tokens: torch.Tensor
    start: int
    parent: int
    children: list[int] = field(default_factory=list)
    rows: torch.Tensor = None  # type: ignore[assignment]
    entry_row: torch.Tensor = None  # type: ignore[assignment]
    entry_ids: torch.Tensor = None  # type: ignore[assignment]
    entry_target: torch.Tensor = None  # type: ignore[assignment]
    context_only: bool = False
    node: int = -1
    offset: int = 0
    node_len: int = 0

    @property
    def is_block(self) -> bool:
        """Whether the unit is one block of a longer node."""
        return self.node_len != len(self.tokens)


def plan(forest: PrefixForest, block_size: int | None = None) -> tuple[list[Unit], list[int]]:
    """Cut forest nodes into execution units of at most ``block_size`` tokens (None: whole nodes).

    Computed on the host once per forest and block size (a forest is immutable).

    Returns:
        The units in depth-first pre-order, and the indices of the roots.
    """
    cache = forest.__dict__.setdefault("_plans", {})
    if block_size not in cache:
        cache[block_size] = _plan(forest, block_size)
    return cache[block_size]


def _plan(forest: PrefixForest, block_size: int | None) -> tuple[list[Unit], list[int]]:
    units: list[Unit] = []
    last_unit: dict[int, int] = {}
    roots: list[int] = []
    for node in forest.nodes:
        n = len(node.tokens)
        bs = n if block_size is None else block_size
        tokens = node.tokens.numpy()
        # Absolute row offset of every entry inside the node.
        if node.num_entries:
            entry_rows_abs = node.rows.numpy()[node.entry_row.numpy()]
            targets = node.entry_target.numpy()
        else:
            entry_rows_abs = targets = np.zeros(0, dtype=np.int64)
        parent = last_unit[node.parent] if node.parent >= 0 else -1
        for b0 in range(0, n, bs):
            b1 = min(b0 + bs, n)
            lo, hi = (int(i) for i in np.searchsorted(entry_rows_abs, [b0, b1]))
            rows, inverse = np.unique(entry_rows_abs[lo:hi], return_inverse=True)
            inverse = inverse.reshape(-1).astype(np.int64)
            unit = Unit(
                tokens=torch.from_numpy(tokens[b0:b1]),
                start=node.start + b0,
                parent=parent,
                rows=torch.from_numpy((rows - b0).astype(np.int64)),
                entry_row=torch.from_numpy(inverse),
                entry_ids=torch.from_numpy(
                    np.arange(node.entry_offset + lo, node.entry_offset + hi, dtype=np.int64)
                ),
                entry_target=torch.from_numpy(np.ascontiguousarray(targets[lo:hi])),
                context_only=node.start + b1 <= node.first_scored,
                node=node.index,
                offset=b0,
                node_len=n,
            )
            idx = len(units)
            units.append(unit)
            (units[parent].children if parent >= 0 else roots).append(idx)
            parent = idx
        last_unit[node.index] = parent
    return units, roots


def collapsed(forest: PrefixForest, max_tokens: int) -> tuple[list[Unit], list[int]]:
    """The whole-node plan with short internal nodes below the roots copied into their children.

    A level-batched pass runs the decoder once per depth of the forest, and completions that
    share their first few tokens add a depth (a node of those tokens between the prompt and the
    completions). Where a node's copies would add at most ``max_tokens`` tokens of work
    (``len(node) * (children - 1)``), each child instead carries the node's tokens itself: the
    node's keys, values and gradient are computed once per child, which sums to the same gradient.
    Each entry the node scores goes to exactly one copy: the one of the child whose first token
    it predicts (at the node's last row), else the first child's (so the node's last row, which
    predicts every child's first token, is evaluated by the LM head once per copy). Roots are
    never copied.

    Returns:
        The units in depth-first pre-order and the indices of the roots (cached per forest).
    """
    cache = forest.__dict__.setdefault("_plans", {})
    key = ("collapsed", max_tokens)
    if key not in cache:
        units, roots = plan(forest, None)
        cache[key] = _collapse(units, roots, max_tokens)
    return cache[key]


def _collapse(units: list[Unit], roots: list[int], max_tokens: int) -> tuple[list[Unit], list[int]]:
    out: list[Unit] = []
    new_roots: list[int] = []

    def visit(unit: Unit, parent: int, depth: int) -> None:
        kids = unit.children
        if depth > 0 and kids and len(unit.tokens) * (len(kids) - 1) <= max_tokens:
            for k, c in enumerate(kids):
                visit(_prepend(unit, units[c], k == 0), parent, depth)
            return
        index = len(out)
        out.append(dataclasses.replace(unit, parent=parent, children=[]))
        (out[parent].children if parent >= 0 else new_roots).append(index)
        for c in kids:
            visit(units[c], index, depth + 1)

    for r in roots:
        visit(units[r], -1, 0)
    return out, new_roots


def _prepend(node: Unit, child: Unit, first: bool) -> Unit:
    """``child`` with ``node``'s tokens in front, and the entries of ``node`` this copy scores."""
    n = len(node.tokens)
    rows = node.rows.numpy()[node.entry_row.numpy()]  # each entry's row inside the node
    target = node.entry_target.numpy()
    last = rows == n - 1
    mine = (last & (target == int(child.tokens[0]))) | (~last & first)
    all_rows = np.concatenate([rows[mine], child.rows.numpy()[child.entry_row.numpy()] + n])
    uniq, inverse = np.unique(all_rows, return_inverse=True)
    return dataclasses.replace(
        child,
        tokens=torch.from_numpy(np.concatenate([node.tokens.numpy(), child.tokens.numpy()])),
        start=node.start,
        rows=torch.from_numpy(uniq.astype(np.int64)),
        entry_row=torch.from_numpy(inverse.reshape(-1).astype(np.int64)),
        entry_ids=torch.from_numpy(np.concatenate([node.entry_ids.numpy()[mine], child.entry_ids.numpy()])),
        entry_target=torch.from_numpy(np.concatenate([target[mine], child.entry_target.numpy()])),
        context_only=node.context_only and child.context_only,
        offset=0,
        node_len=n + len(child.tokens),
    )
