"""Counting what a pass asks of the device: ATen ops, host-device synchronisations, copies.

A GPU charges for what a CPU hides: each op is a kernel launch (microseconds of host time), each
read of a device value stalls the host until the device drains, each copy moves bytes. A
:class:`DispatchCounter` counts them on any device by intercepting ATen ops (a
``TorchDispatchMode``), so the budgets of a GPU-shaped pass can be tested on a CPU.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SYNC_OPS", "DispatchCounter", "PassCounts", "count_call", "count_dense"]

#: ATen ops that read a device value on the host (a synchronisation on CUDA): ``.item()``/``int()``,
#: data-dependent output shapes (``nonzero``, boolean masking, ``unique``), ``.tolist()``.
SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::nonzero",
        "aten::nonzero_static",
        "aten::masked_select",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::repeat_interleave",  # without output_size its length is read from the device
        "aten::equal",
        "aten::is_nonzero",
        "aten::allclose",
    }
)


class DispatchCounter(TorchDispatchMode):
    """Counts ATen ops dispatched inside ``with counter:``.

    Attributes:
        ops: per op name (``aten::mm``), how many ran (views included).
        syncs: per op name, those of :data:`SYNC_OPS`.
        copies: ``_to_copy``/``copy_`` calls whose source and destination devices differ, and
            every ``_to_copy`` that changes device (host <-> device traffic).
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        name = f"aten::{func._schema.name.split('::')[-1]}"
        if func._overloadpacket is torch.ops.aten.repeat_interleave and kwargs.get("output_size") is not None:
            pass  # the length is given: no read of the device
        elif name in SYNC_OPS:
            self.syncs[name] += 1
        self.ops[name] += 1
        if func._overloadpacket is torch.ops.aten._to_copy and "device" in kwargs:
            src = args[0].device if isinstance(args[0], torch.Tensor) else None
            if src is not None and torch.device(kwargs["device"]) != src:
                self.copies += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        """Every op counted."""
        return sum(self.ops.values())

    def non_view(self) -> int:
        """Ops that are not views or metadata changes (what launches work on a device)."""
        return sum(n for name, n in self.ops.items() if not _is_view(name))

    @property
    def sync_count(self) -> int:
        return sum(self.syncs.values())


_VIEWS = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::alias", "aten::detach", "aten::t",
    "aten::transpose", "aten::permute", "aten::expand", "aten::slice", "aten::select", "aten::unsqueeze",
    "aten::squeeze", "aten::as_strided", "aten::split", "aten::split_with_sizes", "aten::unbind",
    "aten::narrow", "aten::chunk", "aten::view_as", "aten::lift_fresh", "aten::_reshape_alias",
    "aten::promote_types",  # a dtype computed on the host, dispatched but launching nothing
}  # fmt: skip


def _is_view(name: str) -> bool:
    return name in _VIEWS


@dataclass
class PassCounts:
    """What one executor call (``score`` or ``backward``) asked of the device.

    Attributes:
        ops: non-view ATen ops of the whole call (kernel launches on a GPU).
        syncs: synchronising ops inside the pass itself (:data:`SYNC_OPS`).
        call_syncs: those of the whole call (the checks before the pass included).
        decoder_runs: forwards of the decoder.
        moves: ``Tensor.to`` calls naming a device made by forkrl's core inside the pass (each a
            host-device copy on a GPU; the CPU hides them, so they are counted where they are asked for).
    """

    ops: int
    syncs: int
    call_syncs: int
    decoder_runs: int
    moves: int


_CORE = str(Path(__file__).resolve().parents[1])
_TESTING = str(Path(__file__).resolve().parent)


def _names_device(args: tuple, kwargs: dict) -> bool:
    if "device" in kwargs:
        return True
    for a in args:
        if isinstance(a, (torch.device, torch.Tensor)):
            return True
        if isinstance(a, str):
            return True  # a device name ("cuda:0"): dtypes are not strings
    return False


@contextlib.contextmanager
def _counting_moves(out: list[int]) -> Iterator[None]:
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        if _names_device(args, kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(_CORE) and not caller.startswith(_TESTING):
                out[0] += 1
        return original(self, *args, **kwargs)

    torch.Tensor.to = to
    try:
        yield
    finally:
        torch.Tensor.to = original


def count_call(executor, call: Callable[[], object]) -> PassCounts:
    """Run ``call`` (a ``score`` or ``backward`` of ``executor``, a :class:`TreeExecutor`) and count
    what it dispatched; the pass is the executor's ``_run``."""
    whole, moves, runs = DispatchCounter(), [0], [0]
    inner: list[DispatchCounter] = []
    run = executor._run

    def counted_run(*args, **kwargs):
        c = DispatchCounter()
        inner.append(c)
        with c, _counting_moves(moves):
            return run(*args, **kwargs)

    hook = executor.adapter.decoder.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    executor._run = counted_run
    try:
        with whole:
            call()
    finally:
        del executor._run
        hook.remove()
    return PassCounts(
        ops=whole.non_view(),
        syncs=sum(c.sync_count for c in inner),
        call_syncs=whole.sync_count,
        decoder_runs=runs[0],
        moves=moves[0],
    )


def count_dense(model, sequences: list[list[int]], score_from: list[int], micro_batch: int) -> PassCounts:
    """The plain computation's counts: per micro-batch of ``micro_batch`` sequences (right-padded,
    with an attention mask, as hosts pack them), one forward, log-probs of the scored tokens and one
    backward of their sum. The head runs from the micro-batch's first scored position on, as TRL's
    ``logits_to_keep`` runs it: two ops more per micro-batch than over every position (the slice's
    copy and its backward), at a fraction of the time when the vocabulary is large."""
    counter, runs = DispatchCounter(), 0
    device = next(model.parameters()).device
    batches = []
    for i in range(0, len(sequences), micro_batch):
        chunk = sequences[i : i + micro_batch]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        scored = torch.zeros(len(chunk), width - 1)
        for b, seq in enumerate(chunk):
            ids[b, : len(seq)] = torch.tensor(seq)
            mask[b, : len(seq)] = 1
            scored[b, score_from[i + b] - 1 : len(seq) - 1] = 1
        first = min(score_from[i : i + micro_batch]) - 1  # the first position whose logits are scored
        batches.append((ids.to(device), mask.to(device), scored[:, first:].to(device), width - first))
    with counter:
        for ids, mask, scored, keep in batches:
            runs += 1
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
            logp = logits[:, :-1].float().log_softmax(-1)
            lp = logp.gather(-1, ids[:, ids.shape[1] - keep + 1 :, None])[..., 0]
            (lp * scored).sum().backward()
    return PassCounts(
        ops=counter.non_view(),
        syncs=counter.sync_count,
        call_syncs=counter.sync_count,
        decoder_runs=runs,
        moves=0,
    )
