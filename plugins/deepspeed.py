"""DeepSpeed ZeRO-3, for the plugins whose hosts train with it (TRL through accelerate, OpenRLHF).

A ZeRO-3 engine keeps each parameter as a partition: ``ds_id`` marks it, ``ds_shape`` is its whole
shape, ``ds_process_group`` its group, and its data is empty outside a gather. The tree step makes
every partition whole once per optimizer step with :func:`gathered` (DeepSpeed's own
``GatheredParameters``, in ``ds_id`` order, the same on every rank; ``modifier_rank=None``, so
nothing is broadcast back on exit) and runs on a replica aliasing the whole tensors
(:class:`forkrl.core.train.AliasReplica`, given ``gather=gathered``). core reads the attributes
only; this module is where DeepSpeed is imported, and :func:`check` is its contract, run by the
tests of every environment that installs DeepSpeed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["CHECKED", "check", "gathered"]

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


def check() -> None:
    """Raise AssertionError when the installed DeepSpeed no longer behaves as forkrl relies on:
    ``GatheredParameters(params, modifier_rank)``, and a ZeRO-3 partition's ``ds_id``/``ds_shape``
    with empty data outside a gather and whole data inside (a one-process ZeRO-3 engine)."""
    import inspect

    import deepspeed
    import torch.distributed as dist

    params = list(inspect.signature(deepspeed.zero.GatheredParameters.__init__).parameters)
    assert params[1:3] == ["params", "modifier_rank"], f"GatheredParameters{params} ({CHECKED})"
    if not dist.is_initialized():
        return  # the partition's attributes need a process group (the plugins' tests have one)
    model = torch.nn.Linear(4, 3)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    weight = model.weight
    assert hasattr(weight, "ds_id") and tuple(weight.ds_shape) == (3, 4), (
        f"ZeRO-3 partition attributes ({CHECKED})"
    )
    assert dist.get_backend(weight.ds_process_group), f"a ZeRO-3 partition's ds_process_group ({CHECKED})"
    assert weight.numel() == 0, f"a ZeRO-3 partition outside a gather holds data ({CHECKED})"
    with gathered([weight]):
        assert tuple(weight.shape) == (3, 4), f"GatheredParameters left a partition empty ({CHECKED})"
    assert weight.numel() == 0, f"GatheredParameters did not partition again on exit ({CHECKED})"
