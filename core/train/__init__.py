"""The host-neutral training step every plugin calls (see :mod:`.step`).

- :mod:`.options`: :class:`TreeOptions`, the tree-training flags of every host, defined once.
- :mod:`.step`: :class:`TreeStep` (score, train), :class:`StepMetrics` (the ``tree/*`` figures).
- :mod:`.distributed`: the data-parallel gradient average and cross-rank metrics.
- :mod:`.sharded`: the step under FSDP2 (gather once into a plain replica, reduce once) and under
  engines that reduce through parameter hooks (DeepSpeed ZeRO 0-2: an aliasing replica).
"""

from .distributed import all_ok, all_reduce_gradients, gather_shares, share_micro_batches, world_size
from .options import DEFAULT_BLOCK_SIZE, DEFAULT_REPLAY_THRESHOLD, TREE_MODES, TreeMode, TreeOptions
from .sharded import AliasReplica, FSDP2Replica, Gather, is_fsdp2, is_zero3
from .step import MODE_CODES, StepMetrics, StepResult, TreeStep

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_REPLAY_THRESHOLD",
    "AliasReplica",
    "FSDP2Replica",
    "MODE_CODES",
    "TREE_MODES",
    "StepMetrics",
    "Gather",
    "StepResult",
    "TreeMode",
    "TreeOptions",
    "TreeStep",
    "all_ok",
    "all_reduce_gradients",
    "gather_shares",
    "is_fsdp2",
    "is_zero3",
    "share_micro_batches",
    "world_size",
]
