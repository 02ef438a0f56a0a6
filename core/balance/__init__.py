"""Tree-aware data-parallel balancing (see :mod:`.plan`) with a cost model fitted to timings (:mod:`.cost`).

Hosts are not wired to it yet: a plugin calls :func:`balance` on the step's forest (its
:func:`trees_of_forest`) before rows are split over ranks, and moves rows as the plan says.
"""

from .cost import CostModel, PieceStats
from .plan import BalancePlan, Tree, balance, evaluate, rows_bound, trees_of_forest

__all__ = [
    "BalancePlan",
    "CostModel",
    "PieceStats",
    "Tree",
    "balance",
    "evaluate",
    "rows_bound",
    "trees_of_forest",
]
