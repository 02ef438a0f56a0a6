"""Where a tree step's collectives run: one :class:`ParallelContext` per host call.

A host's data parallelism reaches the step in four ways, each a field here: the process group its
ranks share, whether the step averages their gradients itself (the tree runs on the unwrapped
module, so a DDP wrapper's hooks never fire), whether the host's engine runs collectives right after
the step (then a failure on one rank must be raised on every rank first), and the device the host's
tensors live on. Which ranks balance rows among themselves, and over which the ``tree/*`` figures
are combined (hosts whose logger averages ranks itself keep each rank's own), may differ from the
gradient's group (veRL: rows move within a data-parallel group, FSDP gathers over the world).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .distributed import world_size

__all__ = ["ParallelContext"]


@dataclass(frozen=True)
class ParallelContext:
    """How one tree step relates to the other ranks of the host.

    Attributes:
        device: where the host's tensors live (the loss's leaves, the collectives' buffers);
            None: the model's device.
        group: the ranks of the step's gradient collectives (the data-parallel group, or a sharded
            engine's; None: the world, also without ``torch.distributed``): a failure on one is
            raised on all of them first.
        average_gradients: the step averages ``param.grad`` over ``group`` itself, as DDP's hooks
            would have (a DDP host; engines that reduce on their own leave it off).
        lockstep: the host runs collectives over ``group`` right after the step (an engine's
            gradient reduction): a failure on any rank is raised on every rank first.
        balance_group: the ranks rows move between and the cost model gathers its samples from;
            None: ``group``.
        metrics_group: the group the ``tree/*`` figures are combined over (token counts summed,
            times maxed); None: ``group``.
        local_metrics: keep this rank's own figures (a host whose logger averages the ranks).
    """

    device: torch.device | str | None = None
    group: Any = None
    average_gradients: bool = False
    lockstep: bool = False
    balance_group: Any = None
    metrics_group: Any = None
    local_metrics: bool = False

    @property
    def ranks(self) -> int:
        """Ranks in ``group`` (1 without an initialised process group)."""
        return world_size(self.group)

    @property
    def collective(self) -> bool:
        """Whether other ranks wait on this step's outcome (a failure must reach them)."""
        return self.average_gradients or self.lockstep
