"""Tree-aware data-parallel balancing (see :mod:`.plan`) with a cost model fitted to timings (:mod:`.cost`).

A plugin either calls :func:`balance` on the step's forest (its :func:`trees_of_forest`) before
rows are split over ranks, or lets :func:`rebalance` (:mod:`.exchange`) gather the ranks' rows,
plan and hand each rank its share (TRL's ``tree_balance``). :class:`OnlineCostModel` fits the cost
model to the steps trained so far (every rank's shapes and timings), the same on every rank.
:class:`BalanceOption` (:mod:`.rules`) is when rows may move at all, the rule every host's
``tree_balance`` follows.
"""

from .cost import CostModel, OnlineCostModel, PieceStats
from .exchange import Rebalanced, padded, prompt_response, rebalance
from .plan import BalancePlan, Tree, balance, evaluate, forest_stats, rows_bound, trees_of_forest
from .rules import BalanceOption

__all__ = [
    "BalanceOption",
    "BalancePlan",
    "CostModel",
    "OnlineCostModel",
    "PieceStats",
    "Rebalanced",
    "Tree",
    "balance",
    "evaluate",
    "forest_stats",
    "padded",
    "prompt_response",
    "rebalance",
    "rows_bound",
    "trees_of_forest",
]
