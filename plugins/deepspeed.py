"""DeepSpeed ZeRO-3, for the plugins whose hosts train with it (TRL through accelerate, OpenRLHF).

A ZeRO-3 engine keeps each parameter as a partition: ``ds_id`` marks it, ``ds_shape`` is its whole
shape, ``ds_process_group`` its group, and its data is empty outside a gather. The tree step makes
every partition whole once per optimizer step with :func:`gathered` (DeepSpeed's own
``GatheredParameters``, in ``ds_id`` order, the same on every rank; ``modifier_rank=None``, so
nothing is broadcast back on exit) and runs on a replica aliasing the whole tensors
(:class:`forkrl.core.train.AliasReplica`, given ``gather=gathered``). core reads the attributes
only; this module is where DeepSpeed is imported, and :data:`PRIVATES` its contract (one
:class:`~forkrl.core.compat.Private` per fact relied on), run by the tests of every environment
that installs DeepSpeed.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch

from forkrl.core.compat import Private

__all__ = ["CHECKED", "PRIVATES", "check", "gathered"]

CHECKED = "deepspeed 0.19.6"


@contextlib.contextmanager
def gathered(params: list[torch.Tensor]) -> Iterator[None]:
    """Every ZeRO-3 partition in ``params`` whole for the context, partitioned again on exit.

    On a gloo process group the partitions are gathered one at a time: DeepSpeed's coalesced gather
    launches one asynchronous all-gather per parameter and waits on the last only (NCCL completes
    them in order on one stream; gloo does not), which was seen to hand back a partly gathered
    parameter on 2 CPU ranks. NCCL keeps the one coalesced gather.
    """
    import deepspeed
    import torch.distributed as dist

    if not params:
        yield
        return
    if dist.get_backend(getattr(params[0], "ds_process_group", None)) != "gloo":
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
        return
    with contextlib.ExitStack() as stack:
        for p in sorted(
            {id(p): p for p in params}.values(), key=lambda p: p.ds_id
        ):  # the same order everywhere
            stack.enter_context(deepspeed.zero.GatheredParameters([p], modifier_rank=None))
        yield


def _gathered_parameters() -> None:
    import deepspeed

    params = list(inspect.signature(deepspeed.zero.GatheredParameters.__init__).parameters)
    assert params[1:3] == ["params", "modifier_rank"], f"GatheredParameters{params}"


def _zero3_partition() -> None:
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        return  # a partition needs a process group (the plugins' DeepSpeed tests have one)
    model = torch.nn.Linear(4, 3)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    weight = model.weight
    assert hasattr(weight, "ds_id") and tuple(weight.ds_shape) == (3, 4), "ZeRO-3 partition attributes"
    assert dist.get_backend(weight.ds_process_group), "a ZeRO-3 partition's ds_process_group"
    assert weight.numel() == 0, "a ZeRO-3 partition outside a gather holds data"
    with gathered([weight]):
        assert tuple(weight.shape) == (3, 4), "GatheredParameters left a partition empty"
    assert weight.numel() == 0, "GatheredParameters did not partition again on exit"


#: What forkrl's ZeRO-3 gathering relies on in DeepSpeed (the one registry form, checked by the TRL
#: and OpenRLHF contract tests, and on a real partition by :func:`check` in their DeepSpeed tests).
PRIVATES: tuple[Private, ...] = (
    Private(
        "DeepSpeed",
        "deepspeed.zero.GatheredParameters(params, modifier_rank)",
        "gathered() makes every ZeRO-3 partition whole once per optimizer step with it, modifier_rank=None so "
        "nothing is broadcast back on exit",
        _gathered_parameters,
        CHECKED,
    ),
    Private(
        "DeepSpeed",
        "a ZeRO-3 partition's ds_id, ds_shape, ds_process_group; empty outside a gather, whole inside",
        "core reads them by attribute (forkrl.core.compat.deepspeed: which parameters are partitions, their "
        "whole shapes) and the tree's replica aliases the whole tensors inside gathered(); checked on a real "
        "partition where a process group exists",
        _zero3_partition,
        CHECKED,
    ),
)


def check() -> None:
    """Check every entry of :data:`PRIVATES` (in a process group: on a real ZeRO-3 partition).

    Raises:
        AssertionError: naming the entry, what changed and what forkrl relies on it for.
    """
    for private in PRIVATES:
        private.check()
