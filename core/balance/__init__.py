"""Tree-aware data-parallel balancing (see :mod:`.plan`) with a cost model fitted to timings (:mod:`.cost`).

A plugin either calls :func:`balance` on the step's forest (its :func:`trees_of_forest`) before
rows are split over ranks, or lets :func:`rebalance` (:mod:`.exchange`) gather the ranks' rows,
plan and hand each rank its share (TRL's ``tree_balance``).
"""

from .cost import CostModel, PieceStats
from .exchange import Rebalanced, rebalance
from .plan import BalancePlan, Tree, balance, evaluate, rows_bound, trees_of_forest

__all__ = [
    "BalancePlan",
    "CostModel",
    "PieceStats",
    "Rebalanced",
    "Tree",
    "balance",
    "evaluate",
    "rebalance",
    "rows_bound",
    "trees_of_forest",
]
