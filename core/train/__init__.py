"""The host-neutral training step every plugin calls (see :mod:`.step`).

- :mod:`.options`: :class:`TreeOptions`, the tree-training flags of every host, defined once.
- :mod:`.step`: :class:`TreeStep` (score, train), :class:`StepMetrics` (the ``tree/*`` figures).
- :mod:`.distributed`: the data-parallel gradient average and cross-rank metrics.
"""

from .distributed import all_reduce_gradients, world_size
from .options import DEFAULT_BLOCK_SIZE, TREE_MODES, TreeMode, TreeOptions
from .step import MODE_CODES, StepMetrics, StepResult, TreeStep

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "MODE_CODES",
    "TREE_MODES",
    "StepMetrics",
    "StepResult",
    "TreeMode",
    "TreeOptions",
    "TreeStep",
    "all_reduce_gradients",
    "world_size",
]
