"""Where a tree step's collectives run: one :class:`ParallelContext` per host call.

A host's data parallelism reaches the step in four ways, each a field here: the process group its
ranks share, whether the step averages their gradients itself (the tree runs on the unwrapped
module, so a DDP wrapper's hooks never fire), whether the host's engine runs collectives right after
the step (then a failure on one rank must be raised on every rank first), and the device the host's
tensors live on. Which ranks balance rows among themselves, and over which the ``tree/*`` figures
are combined (hosts whose logger averages ranks itself keep each rank's own), may differ from the
gradient's group (veRL: rows move within a data-parallel group, FSDP gathers over the world).

A refusal a host decides from its own rank's rows (images it cannot take, say) is agreed over the
ranks before the step's first collective with :func:`agreed`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .distributed import all_ok, world_size

__all__ = ["ParallelContext", "agreed"]

T = TypeVar("T")


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
        context_parallel: with ``long_context_replay``, the ranks that hold the same rows and split
            each prompt between them (:class:`~forkrl.core.executor.cp_executor.ContextParallelExecutor`:
            a host's sequence-parallel group); every rank ends with the whole step's gradient, as
            if it had run the rows alone. None: each rank runs its rows by itself.
        context_parallel_rows: ``"shared"``: the ``context_parallel`` ranks hold the same rows (a
            sequence-parallel group); ``"own"``: each holds its own (data-parallel ranks grouped,
            TRL), and the step trains the group's union (:class:`~forkrl.core.train.union.GroupRows`),
            each rank keeping its own rows' losses and values and its share of the gradient, which
            the data-parallel average over ``group`` (``average_gradients`` or the engine's) completes.
    """

    device: torch.device | str | None = None
    group: Any = None
    average_gradients: bool = False
    lockstep: bool = False
    balance_group: Any = None
    metrics_group: Any = None
    local_metrics: bool = False
    context_parallel: Any = None
    context_parallel_rows: str = "shared"

    @property
    def ranks(self) -> int:
        """Ranks in ``group`` (1 without an initialised process group)."""
        return world_size(self.group)

    @property
    def collective(self) -> bool:
        """Whether other ranks wait on this step's outcome (a failure must reach them)."""
        return self.average_gradients or self.lockstep


def agreed(
    check: Callable[[], T],
    device: torch.device | str | int,
    elsewhere: Exception,
    group: Any = None,
    catch: tuple[type[Exception], ...] = (ValueError,),
) -> T:
    """``check()``, its refusal agreed over the ranks of ``group`` (None: the world) before a collective.

    A host decides some refusals from its own rank's rows; a rank that raised alone would leave the
    others waiting in the step's first collective. Here every rank learns whether any refused: the
    refusing rank raises its own error, every other rank ``elsewhere``, and nothing has changed on any.

    Args:
        check: returns what the host needs, or raises one of ``catch`` (ValueError, with
            ``UnsupportedModelError``, by default) to refuse.
        device: where the agreement's flag lives (the host's collective device).
        elsewhere: what a rank that did not refuse raises (naming the other rank's error as the cause).
        catch: the errors that count as a refusal (a step's own failures: also TypeError and
            RuntimeError); any other propagates at once.
    """
    result, error = None, None
    try:
        result = check()
    except catch as err:
        error = err
    if not all_ok(error is None, device, group):
        raise error if error is not None else elsewhere
    return result
