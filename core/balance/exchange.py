"""Moving one step's rows between data-parallel ranks as the balancer plans (host-neutral).

Every rank passes the rows it holds (any picklable records: a host keeps its per-row tensors in
them) and a function giving a row's token sequence; :func:`rebalance` gathers all ranks' rows,
plans with :func:`~forkrl.core.balance.balance` on the group's first rank, sends the plan to the
others (each rank's own fitted cost model agrees only up to rounding) and returns the rows this
rank trains. The host then collates them into its own micro-batches (:func:`padded`,
:func:`prompt_response`: its per-row tensors padded again to the new rows); the update is unchanged
wherever its loss normalisation does not depend on which rows share a rank or micro-batch (per-row
terms with equal rows per micro-batch, or global token counts), which the host checks before
switching balancing on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..tree import PrefixForest
from .cost import CostModel
from .plan import balance, evaluate, trees_of_forest

__all__ = ["Rebalanced", "padded", "prompt_response", "rebalance"]

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

    def metrics(self, prefix: str = "tree/", measured: list[float] | None = None) -> dict[str, float]:
        """``tree/balance_*`` scalars for a host's logger (the same on every rank).

        ``balance_predicted_makespan`` is the plan's slowest rank in the cost model's units
        (seconds once the model is fitted); with ``measured`` (every rank's measured seconds of
        the step, from :meth:`OnlineCostModel.observe`), ``balance_measured_makespan`` is the
        slowest rank's and ``balance_measured_imbalance`` the slowest over the mean (1.0: no rank
        waits)."""
        out = {
            f"{prefix}balance_moved_rows": float(self.moved),
            f"{prefix}balance_predicted_gain": self.predicted_before / max(self.predicted_after, 1e-30),
            f"{prefix}balance_makespan_ratio": self.predicted_after / max(self.lower_bound, 1e-30),
            f"{prefix}balance_predicted_makespan": self.predicted_after,
            f"{prefix}balance_time": self.seconds,
        }
        if measured:
            slowest = max(measured)
            out[f"{prefix}balance_measured_makespan"] = slowest
            out[f"{prefix}balance_measured_imbalance"] = slowest / max(sum(measured) / len(measured), 1e-30)
        return out


def rebalance(
    rows: Sequence[R],
    sequence: Callable[[R], tuple[list[int], int]],
    model: CostModel | None = None,
    group=None,
    equal_rows: bool = True,
    min_rows: int = 1,
) -> Rebalanced:
    """Gather every rank's ``rows``, plan, and return this rank's share.

    Args:
        rows: this rank's rows (with ``equal_rows``, every rank must hold the same number).
        sequence: a row's ``(tokens, score_from)``: what the balancer prices.
        model: the cost model (default: one unit per token); only the group's first rank's is used.
        group: the data-parallel process group (default: the world).
        equal_rows: every rank keeps its number of rows (hosts whose ranks must hold equal row
            counts); False: any number per rank, at least one (hosts whose loss normalisation and
            collectives do not depend on a rank's row count).
        min_rows: without ``equal_rows``, the fewest rows a rank may get (a host that keeps its
            micro-batch count needs one row per micro-batch); a plan that gives a rank fewer is
            replaced by the equal-rows plan when the ranks hold equal counts, else by no move.

    Raises:
        ValueError: on every rank, when ``equal_rows`` and the ranks hold different numbers of rows
            (before anything moved).
    """
    start = time.perf_counter()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, list(rows), group=group)
    counts = [len(part) for part in gathered]
    if equal_rows and len(set(counts)) != 1:
        raise ValueError(
            f"tree_balance needs the same number of rows on every data-parallel rank, got {counts}: set "
            "tree_balance='off', or make the per-rank batch sizes equal"
        )
    flat = [row for part in gathered for row in part]
    starts = [sum(counts[:r]) for r in range(world)]
    original = [list(range(starts[r], starts[r] + counts[r])) for r in range(world)]
    # The plan is made on the group's first rank and sent to the others: a cost model fitted on each
    # rank agrees only up to rounding (LAPACK's least squares differs in its last bits between
    # processes), and a near-tie would then split the ranks' plans: rows trained twice or never.
    decision = [_plan(flat, sequence, original, model, equal_rows, min_rows) if rank == 0 else None]
    dist.broadcast_object_list(
        decision, src=0 if group is None else dist.get_global_rank(group, 0), group=group
    )
    ranks, predicted_before, predicted_after, lower_bound = decision[0]
    home = {s: r for r, ids in enumerate(original) for s in ids}
    where = {s: r for r, ids in enumerate(ranks) for s in ids}
    moved = sum(1 for s in range(len(flat)) if where[s] != home[s])
    return Rebalanced(
        rows=[flat[s] for s in ranks[rank]],
        moved=moved,
        predicted_before=predicted_before,
        predicted_after=predicted_after,
        lower_bound=lower_bound,
        seconds=time.perf_counter() - start,
    )


def _plan(
    flat: Sequence[R],
    sequence: Callable[[R], tuple[list[int], int]],
    original: list[list[int]],
    model: CostModel | None,
    equal_rows: bool,
    min_rows: int,
) -> tuple[list[list[int]], float, float, float]:
    """The step's plan over all ranks' rows (``flat``, in rank order; ``original[r]``: rank ``r``'s
    ids): each rank's ids, the slowest rank's predicted cost before and after, the lower bound."""
    seqs = [sequence(row) for row in flat]
    trees = trees_of_forest(PrefixForest.build([s for s, _ in seqs], [f for _, f in seqs]))
    counts = [len(ids) for ids in original]
    before = evaluate(trees, original, model)
    plan = balance(trees, len(original), model, rows_per_rank=counts[0] if equal_rows else None)
    if not equal_rows and any(len(ids) < max(min_rows, 1) for ids in plan.ranks):
        plan = (
            balance(trees, len(original), model, rows_per_rank=counts[0]) if len(set(counts)) == 1 else before
        )
    if plan.makespan >= before.makespan:  # nothing to gain: keep the rows where they are
        plan = before
    return [list(ids) for ids in plan.ranks], before.makespan, plan.makespan, plan.lower_bound


def padded(parts: Sequence[torch.Tensor], width: int, *, left: bool = False, fill: float = 0) -> torch.Tensor:
    """A per-row field collated again: ``[B, width, ...]`` from rows ``[n_b, ...]`` (``n_b <= width``),
    each row's entries first (right padding) or, with ``left``, last (left padding); the rest ``fill``."""
    block = parts[0].new_full((len(parts), width, *parts[0].shape[1:]), fill)
    for b, p in enumerate(parts):
        if left:
            block[b, width - p.shape[0] :] = p
        else:
            block[b, : p.shape[0]] = p
    return block


def prompt_response(
    parts: Sequence[torch.Tensor], prompt_lens: Sequence[int], prompt_width: int, width: int
) -> torch.Tensor:
    """Rows laid out ``[left-padded prompt | right-padded response]`` collated again: ``[B, width, ...]``.

    Args:
        parts: per row ``[n_b, ...]``, its prompt then its response, without left padding.
        prompt_lens: per row, how many of its entries are prompt: they end at column ``prompt_width``,
            the rest follow from there (zeros elsewhere).
        prompt_width: the prompt columns (at least every ``prompt_lens[b]``).
        width: all columns (at least ``prompt_width`` plus every response).
    """
    block = parts[0].new_zeros((len(parts), width, *parts[0].shape[1:]))
    for b, (p, own) in enumerate(zip(parts, prompt_lens, strict=True)):
        block[b, prompt_width - own : prompt_width - own + p.shape[0]] = p
    return block
