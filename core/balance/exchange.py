"""Moving one step's rows between data-parallel ranks as the balancer plans (host-neutral).

Every rank passes the rows it holds (any picklable records: a host keeps its per-row tensors in
them) and a function giving a row's token sequence; :func:`rebalance` gathers all ranks' rows,
plans with :func:`~forkrl.core.balance.balance` (the same plan on every rank: same input, same
deterministic algorithm) and returns the rows this rank trains. The host then collates them into
its own micro-batches; the update is unchanged wherever its loss normalisation does not depend on
which rows share a rank or micro-batch (per-row terms with equal rows per micro-batch, or global
token counts), which the host checks before switching balancing on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from ..tree import PrefixForest
from .cost import CostModel
from .plan import balance, evaluate, trees_of_forest

__all__ = ["Rebalanced", "rebalance"]

R = TypeVar("R")


@dataclass
class Rebalanced:
    """What :func:`rebalance` did: the rows this rank trains and the step's figures.

    Attributes:
        rows: this rank's rows under the plan.
        moved: rows (over all ranks) that changed rank.
        predicted_before / predicted_after: the slowest rank's predicted cost, as the rows came and
            as planned.
        lower_bound: no assignment's slowest rank is cheaper.
        seconds: the gather, the forest and the plan, on this rank.
    """

    rows: list[Any]
    moved: int
    predicted_before: float
    predicted_after: float
    lower_bound: float
    seconds: float

    def metrics(self, prefix: str = "tree/") -> dict[str, float]:
        """``tree/balance_*`` scalars for a host's logger."""
        return {
            f"{prefix}balance_moved_rows": float(self.moved),
            f"{prefix}balance_predicted_gain": self.predicted_before / max(self.predicted_after, 1e-30),
            f"{prefix}balance_makespan_ratio": self.predicted_after / max(self.lower_bound, 1e-30),
            f"{prefix}balance_time": self.seconds,
        }


def rebalance(
    rows: Sequence[R],
    sequence: Callable[[R], tuple[list[int], int]],
    model: CostModel | None = None,
    group=None,
) -> Rebalanced:
    """Gather every rank's ``rows``, plan, and return this rank's share (equal row counts per rank).

    Args:
        rows: this rank's rows (every rank must hold the same number).
        sequence: a row's ``(tokens, score_from)``: what the balancer prices.
        model: the cost model (default: one unit per token).
        group: the data-parallel process group (default: the world).

    Raises:
        ValueError: on every rank, when the ranks hold different numbers of rows (before anything
            moved).
    """
    start = time.perf_counter()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, list(rows), group=group)
    counts = [len(part) for part in gathered]
    if len(set(counts)) != 1:
        raise ValueError(
            f"tree_balance needs the same number of rows on every data-parallel rank, got {counts}: set "
            "tree_balance='off', or make the per-rank batch sizes equal"
        )
    flat = [row for part in gathered for row in part]
    seqs = [sequence(row) for row in flat]
    trees = trees_of_forest(PrefixForest.build([s for s, _ in seqs], [f for _, f in seqs]))
    per_rank = counts[0]
    original = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(world)]
    before = evaluate(trees, original, model)
    plan = balance(trees, world, model, rows_per_rank=per_rank)
    if plan.makespan >= before.makespan:  # nothing to gain: keep the rows where they are
        plan = before
    where = {s: r for r, ids in enumerate(plan.ranks) for s in ids}
    moved = sum(1 for s in range(len(flat)) if where[s] != s // per_rank)
    return Rebalanced(
        rows=[flat[s] for s in plan.ranks[rank]],
        moved=moved,
        predicted_before=before.makespan,
        predicted_after=plan.makespan,
        lower_bound=plan.lower_bound,
        seconds=time.perf_counter() - start,
    )
