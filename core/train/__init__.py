"""The host-neutral training step every plugin calls (see :mod:`.step`).

- :mod:`.options`: :class:`TreeOptions`, the tree-training flags of every host, defined once
  (:class:`GroupedRanksOptions`: TRL's ``long_context_cp_size``).
- :mod:`.step`: :class:`TreeStep` (score, train), its inputs (:class:`StepInputs`, :class:`StepLoss`)
  and :class:`StepMetrics` (the ``tree/*`` figures).
- :mod:`.runner`: :class:`TreeRunner`, the loop around the step every host repeats (balancing and its
  cost model, router weights, images, an engine's hand-over, metrics), and the :class:`HostAdapter`
  a host supplies (:class:`HostDefaults`: the answers most hosts give).
- :mod:`.parallel`: :class:`ParallelContext`, how a step relates to the host's other ranks, and
  :func:`agreed`, a host's refusal raised on every rank before the step's collectives.
- :mod:`.union`: :class:`GroupRows`, a context-parallel group whose ranks hold their own rows
  trains and scores their union.
- :mod:`.distributed`: the data-parallel gradient average and cross-rank metrics.
- :mod:`.sharded`: the step under FSDP2 (gather once into a plain replica, reduce once) and under
  engines that reduce through parameter hooks (DeepSpeed ZeRO 0-2: an aliasing replica).
"""

from .distributed import all_ok, all_reduce_gradients, gather_shares, share_micro_batches, world_size
from .options import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_REPLAY_THRESHOLD,
    TREE_MODES,
    GroupedRanksOptions,
    TreeMode,
    TreeOptions,
)
from .parallel import ParallelContext, agreed
from .runner import HostAdapter, HostDefaults, RunResult, TreeRunner, router_value
from .sharded import AliasReplica, FSDP2Replica, Gather, is_fsdp2, is_zero3
from .step import MODE_CODES, StepInputs, StepLoss, StepMetrics, StepResult, TreeStep
from .union import GroupRows

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_REPLAY_THRESHOLD",
    "AliasReplica",
    "FSDP2Replica",
    "MODE_CODES",
    "TREE_MODES",
    "Gather",
    "GroupRows",
    "GroupedRanksOptions",
    "HostAdapter",
    "HostDefaults",
    "ParallelContext",
    "RunResult",
    "StepInputs",
    "StepLoss",
    "StepMetrics",
    "StepResult",
    "TreeMode",
    "TreeOptions",
    "TreeRunner",
    "TreeStep",
    "agreed",
    "all_ok",
    "all_reduce_gradients",
    "gather_shares",
    "is_fsdp2",
    "is_zero3",
    "router_value",
    "share_micro_batches",
    "world_size",
]
