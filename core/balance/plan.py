"""Tree-aware data-parallel balancing: assign one step's sequences to ranks by predicted tree cost.

Length-based balancing (veRL's ``_balance_batch``: Karmarkar-Karp on sequence lengths) spreads a
GRPO group's rows over ranks, and every rank holding part of a group recomputes its shared prompt;
a tree's cost is not the sum of its rows' lengths. Here the unit of assignment is a tree (the rows
that share a root), kept whole unless it costs more than a rank's fair share, in which case its
leaves are cut into consecutive runs (pre-order, so leaves sharing deeper prefixes stay together),
each run paying for its own copy of the shared prefix. Pieces go to ranks largest first, each to
the least-loaded rank that has room for its rows (``rows_per_rank``: hosts whose ranks must hold
equal row counts); then pieces of equal row counts are swapped between the slowest rank and the
lightest ones while that lowers the slowest rank.

The assignment changes which rank computes which rows, not what is computed: the step's gradient
is the same whenever the host's loss normalisation is global (token-mean over the step, as
OpenRLHF's and veRL's windows are), and hosts whose normalisation depends on the batch composition
must compute it on the original composition.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..tree import PrefixForest
from .cost import CostModel, PieceStats

__all__ = ["BalancePlan", "Tree", "balance", "evaluate", "forest_stats", "rows_bound", "trees_of_forest"]

#: A tree costing more than a fraction of a rank's fair share is cut into pieces: the plan is made
#: at the first fraction, and at the next ones while its slowest rank is more than
#: ``RETRY_ABOVE`` times the lower bound (finer pieces fill ranks more evenly, but each piece
#: pays for its own prefix); the best plan is kept.
SPLIT_SHARES = (1.0, 0.75, 0.5)
RETRY_ABOVE = 1.02


@dataclass
class Tree:
    """One tree of a forest: its nodes (``lengths``, absolute ``starts``, ``parent``) and, per
    sequence ending in it, the node path from the root (``paths[k]`` for sequence ``ids[k]``)."""

    lengths: list[int]
    starts: list[int]
    parent: list[int]
    ids: list[int]
    paths: list[list[int]]
    #: Per node, positions whose log-prob is computed (None: every token of a non-root node).
    scored: list[int] | None = None

    def stats(self, leaves: Sequence[int] | None = None) -> PieceStats:
        """The piece of the union of the paths ``leaves`` (indices into ``ids``; all by default)."""
        chosen = range(len(self.ids)) if leaves is None else leaves
        nodes = {n for k in chosen for n in self.paths[k]}
        tokens = attended = scored = 0.0
        for n in nodes:
            length, start = self.lengths[n], self.starts[n]
            tokens += length
            attended += length * start + length * (length + 1) / 2
            scored += self._scored(n)
        return PieceStats(tokens, attended, float(len(nodes)), scored)

    def node_costs(self, model: CostModel) -> list[float]:
        """Each node's predicted cost (the model is linear: a piece costs the sum over its nodes)."""
        scored = self.scored or [
            length if p >= 0 else 0 for length, p in zip(self.lengths, self.parent, strict=True)
        ]
        return [
            model.per_token * length
            + model.per_attended * (length * start + length * (length + 1) / 2)
            + model.per_unit
            + model.per_scored * sc
            for length, start, sc in zip(self.lengths, self.starts, scored, strict=True)
        ]

    def piece_cost(self, nodes: Sequence[float], leaves: Sequence[int]) -> float:
        """The cost of the union of the paths ``leaves``, from :meth:`node_costs`."""
        if len(leaves) == len(self.ids):  # every node of a trie lies on some path
            return sum(nodes)
        return sum(nodes[n] for n in {n for k in leaves for n in self.paths[k]})

    def _scored(self, n: int) -> int:
        if self.scored is not None:
            return self.scored[n]
        return self.lengths[n] if self.parent[n] >= 0 else 0


def trees_of_forest(forest: PrefixForest) -> list[Tree]:
    """The forest's trees (one per root), sequences identified by their index in the forest."""
    local: dict[int, tuple[int, int]] = {}  # node -> (tree, local index)
    trees: list[Tree] = []
    for node in forest.nodes:  # parents come before children
        if node.parent < 0:
            trees.append(Tree([], [], [], [], [], scored=[]))
            t = len(trees) - 1
            parent = -1
        else:
            t, parent = local[node.parent]
        tree = trees[t]
        local[node.index] = (t, len(tree.lengths))
        tree.lengths.append(len(node.tokens))
        tree.starts.append(node.start)
        tree.parent.append(parent)
        tree.scored.append(0 if node.rows is None else len(node.rows))  # the head runs at these rows
    for s, path in enumerate(forest.paths):
        t = local[path[0]][0]
        trees[t].ids.append(s)
        trees[t].paths.append([local[n][1] for n in path])
    return trees


def forest_stats(forest: PrefixForest) -> PieceStats:
    """The summed shape of a whole forest (what a rank training it computes)."""
    total = PieceStats()
    for tree in trees_of_forest(forest):
        total = total + tree.stats()
    return total


@dataclass
class BalancePlan:
    """Per rank, the sequence ids it trains; its predicted costs; the bound no plan beats."""

    ranks: list[list[int]]
    costs: list[float]
    lower_bound: float
    split_trees: int
    seconds: float = 0.0
    pieces: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max(self.costs)

    @property
    def makespan_ratio(self) -> float:
        """Slowest rank over the lower bound (1.0 is optimal)."""
        return self.makespan / self.lower_bound if self.lower_bound > 0 else 1.0


def _lower_bound(trees: Sequence[Tree], nodes_of: Sequence[list[float]], num_ranks: int) -> float:
    """max(total tree cost / ranks, the costliest single row): no plan does better."""
    whole = single = 0.0
    for t, nodes in zip(trees, nodes_of, strict=True):
        whole += sum(nodes)
        single = max(single, max(sum(nodes[n] for n in path) for path in t.paths))
    return max(whole / num_ranks, single)


def rows_bound(trees: Sequence[Tree], model: CostModel, rows_per_rank: int) -> float:
    """A lower bound under equal row counts: the rank holding the costliest row also holds
    ``rows_per_rank - 1`` others, each adding at least its own last node (0 for a row whose last
    node ends other rows too)."""
    paths, margins = [], []
    for t in trees:
        ends: dict[int, int] = {}
        for path in t.paths:
            ends[path[-1]] = ends.get(path[-1], 0) + 1
        for i, path in enumerate(t.paths):
            n = path[-1]
            length = t.lengths[n]
            leaf = PieceStats(length, length * t.starts[n] + length * (length + 1) / 2, 1.0, t._scored(n))
            paths.append(model.predict(t.stats([i])))
            margins.append(model.predict(leaf) if ends[n] == 1 else 0.0)
    others = rows_per_rank - 1
    order = sorted(margins)
    low, low_plus = sum(order[:others]), sum(order[: others + 1])
    cutoff = order[others - 1] if others > 0 else float("-inf")
    return max(c + (low_plus - m if m <= cutoff else low) for c, m in zip(paths, margins, strict=True))


def _cut(tree: Tree, nodes: list[float], parts: int) -> list[list[int]]:
    """Consecutive runs of the tree's leaves (pre-order) of about equal cost, ``parts`` of them."""
    order = sorted(range(len(tree.ids)), key=lambda k: tree.paths[k])
    target = sum(nodes) / parts
    runs: list[list[int]] = [[]]
    seen: set[int] = set()
    run_cost = 0.0
    for k in order:
        new = [n for n in tree.paths[k] if n not in seen]
        added = sum(nodes[n] for n in new)
        if runs[-1] and len(runs) < parts and run_cost + added > target:
            runs.append([])
            seen, run_cost = set(), 0.0
            new = list(tree.paths[k])
            added = sum(nodes[n] for n in new)
        runs[-1].append(k)
        seen.update(new)
        run_cost += added
    return runs


def _pieces(
    trees: Sequence[Tree], nodes_of: Sequence[list[float]], num_ranks: int, share: float
) -> tuple[list[tuple[int, list[int]]], int]:
    whole = [sum(nodes) for nodes in nodes_of]
    fair = sum(whole) / num_ranks
    pieces, split = [], 0
    for i, tree in enumerate(trees):
        parts = min(len(tree.ids), math.ceil(whole[i] / (fair * share))) if fair > 0 else 1
        if parts > 1:
            split += 1
            pieces.extend((i, run) for run in _cut(tree, nodes_of[i], parts))
        else:
            pieces.append((i, list(range(len(tree.ids)))))
    return pieces, split


def balance(
    trees: Sequence[Tree],
    num_ranks: int,
    model: CostModel | None = None,
    rows_per_rank: int | None = None,
) -> BalancePlan:
    """Assign the trees' sequences to ``num_ranks`` ranks, minimising the slowest rank's predicted cost.

    Args:
        trees: one step's trees (:func:`trees_of_forest` of the step's forest).
        num_ranks: data-parallel ranks.
        model: the cost model (default: one unit per token).
        rows_per_rank: every rank must get exactly this many sequences (hosts with fixed
            micro-batches); None: any number.

    Raises:
        ValueError: when ``rows_per_rank * num_ranks`` is not the number of sequences.
    """
    start = time.perf_counter()
    model = model or CostModel()
    total_rows = sum(len(t.ids) for t in trees)
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks} must be >= 1")
    if rows_per_rank is not None and rows_per_rank * num_ranks != total_rows:
        raise ValueError(
            f"rows_per_rank={rows_per_rank} x {num_ranks} ranks != {total_rows} sequences: every rank must get the "
            "same number of rows, so the step's rows must divide evenly"
        )
    nodes_of = [t.node_costs(model) for t in trees]
    plan = None
    for share in SPLIT_SHARES:
        candidate = _plan(trees, nodes_of, model, num_ranks, rows_per_rank, share)
        if plan is None or candidate.makespan < plan.makespan:
            plan = candidate
        if plan.makespan_ratio <= RETRY_ABOVE:
            break
    plan.seconds = time.perf_counter() - start
    return plan


def _plan(
    trees: Sequence[Tree],
    nodes_of: Sequence[list[float]],
    model: CostModel,
    num_ranks: int,
    rows_per_rank: int | None,
    share: float,
) -> BalancePlan:
    """One plan: the trees cut at ``share`` of a rank's fair share, placed largest first, refined."""
    total_rows = sum(len(t.ids) for t in trees)
    pieces, split = _pieces(trees, nodes_of, num_ranks, share)
    capacity = [rows_per_rank if rows_per_rank is not None else total_rows] * num_ranks
    cost = {id(p): trees[p[0]].piece_cost(nodes_of[p[0]], p[1]) for p in pieces}
    queue = deque(sorted(pieces, key=lambda p: -cost[id(p)]))
    loads = [0.0] * num_ranks
    assigned: list[list[tuple[int, list[int]]]] = [[] for _ in range(num_ranks)]
    # Ranks with room, in heaps of (load, rank) by their free rows (one heap without a row limit):
    # the least-loaded rank with room for a piece is the best top of at most rows_per_rank heaps;
    # a full rank leaves them.
    free = (lambda r: capacity[r]) if rows_per_rank is not None else (lambda r: total_rows)
    heaps: dict[int, list[tuple[float, int]]] = {free(0): [(0.0, r) for r in range(num_ranks)]}
    while queue:
        piece = queue.popleft()
        rows = len(piece[1])
        fits = [c for c, heap in heaps.items() if heap and c >= rows]
        if not fits:  # no rank has room for the whole piece: split off what the emptiest can take
            r = heaps[max(c for c, heap in heaps.items() if heap)][0][1]
            head, tail = (piece[0], piece[1][: capacity[r]]), (piece[0], piece[1][capacity[r] :])
            cost[id(head)] = trees[head[0]].piece_cost(nodes_of[head[0]], head[1])
            cost[id(tail)] = trees[tail[0]].piece_cost(nodes_of[tail[0]], tail[1])
            queue.appendleft(tail)
            queue.appendleft(head)
            continue
        load, r = heapq.heappop(heaps[min(fits, key=lambda c: heaps[c][0])])
        assigned[r].append(piece)
        capacity[r] -= rows
        loads[r] = load + cost[id(piece)]
        if capacity[r] > 0:
            heapq.heappush(heaps.setdefault(free(r), []), (loads[r], r))
    _refine(assigned, loads, cost, same_rows=rows_per_rank is not None)
    plan = evaluate(trees, _ids(trees, assigned), model, nodes_of)
    plan.split_trees, plan.pieces = split, pieces
    return plan


def _refine(assigned, loads, cost, same_rows: bool = True) -> None:
    """Swap pieces between the most loaded rank and another while that lowers the slowest rank
    (``assigned`` and ``loads`` are updated). ``same_rows``: only pieces of equal row counts swap,
    so every rank keeps its row count; otherwise any two pieces swap, and a piece may also move to
    the least-loaded rank alone.

    Each round takes, over every piece of every other rank, the swap that lowers the larger of the
    two loads the most: a piece of the top rank swapped with one ``delta`` cheaper on a rank ``gap``
    below gains ``min(delta, gap - delta)`` (a move is a swap with nothing: ``delta`` is the piece's
    cost). The search is one vectorised pass over all pieces per piece of the top rank (thousands
    of ranks: milliseconds per round).
    """
    flat = [p for pieces in assigned for p in pieces]
    if not flat:
        return
    price = torch.tensor([cost[id(p)] for p in flat], dtype=torch.float64)
    rows = torch.tensor([len(p[1]) for p in flat])
    rank = torch.tensor([r for r, pieces in enumerate(assigned) for _ in pieces])
    load = torch.tensor(loads, dtype=torch.float64)
    for _ in range(4 * len(loads)):
        top = int(torch.argmax(load))
        top_load = float(load[top])
        gap = top_load - load[rank]
        others = rank != top
        best, best_gain = None, 1e-12 * top_load
        lightest = int(torch.argmin(load))
        for a in (rank == top).nonzero()[:, 0].tolist():
            delta = price[a] - price
            gain = torch.minimum(delta, gap - delta)
            allowed = others & (delta > 0) & ((rows == rows[a]) if same_rows else True)
            gain = torch.where(allowed, gain, -math.inf)
            b = int(torch.argmax(gain))
            if float(gain[b]) > best_gain:
                best, best_gain = (a, b), float(gain[b])
            if not same_rows and lightest != top:  # the piece alone to the lightest rank
                moved = min(float(price[a]), top_load - float(load[lightest]) - float(price[a]))
                if moved > best_gain:
                    best, best_gain = (a, None), moved
        if best is None:
            break
        a, b = best
        if b is None:
            q, delta = lightest, float(price[a])
            rank[a] = q
        else:
            q, delta = int(rank[b]), float(price[a] - price[b])
            rank[a], rank[b] = q, top
        load[top] -= delta
        load[q] += delta
    for r in range(len(assigned)):
        assigned[r] = [flat[k] for k in (rank == r).nonzero()[:, 0].tolist()]
    loads[:] = load.tolist()


def _ids(trees: Sequence[Tree], assigned) -> list[list[int]]:
    return [[trees[t].ids[k] for t, run in rank for k in run] for rank in assigned]


def evaluate(
    trees: Sequence[Tree],
    ranks: Sequence[Sequence[int]],
    model: CostModel | None = None,
    nodes_of: Sequence[list[float]] | None = None,
) -> BalancePlan:
    """The predicted cost of any assignment of sequence ids to ranks (a rank holding part of a tree
    computes the union of its paths; several parts of one tree on one rank share their prefix).

    ``nodes_of``: each tree's :meth:`Tree.node_costs` under ``model``, when already computed.
    """
    model = model or CostModel()
    if nodes_of is None:
        nodes_of = [t.node_costs(model) for t in trees]
    where = {s: (t, k) for t, tree in enumerate(trees) for k, s in enumerate(tree.ids)}
    costs = []
    for rank in ranks:
        by_tree: dict[int, list[int]] = {}
        for s in rank:
            t, k = where[s]
            by_tree.setdefault(t, []).append(k)
        costs.append(sum(trees[t].piece_cost(nodes_of[t], ks) for t, ks in by_tree.items()))
    return BalancePlan([list(r) for r in ranks], costs, _lower_bound(trees, nodes_of, len(ranks)), 0)
