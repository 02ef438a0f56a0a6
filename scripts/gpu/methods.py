"""The methods a training stage compares: each runs one optimizer step's forward and backward of
``sum(coef * logprob)`` over every completion of a :class:`~gpu.shapes.Batch`, accumulating into
``param.grad``. Everything a method needs is built here, before any clock starts: executors
(through ``TreeStep``, as every host builds them) constructed and their first-use probe run
(``verify()``), packed forests and Prefix Grouper layouts per call, the batches' forests.

    dense           ``forkrl.core.estimate.pricing.dense_step``: the rows in order, micro-batches
                    of at most ``shape.micro_batch_tokens`` tokens (veRL's default token budget;
                    equal row lengths here, so padded batches and veRL's padding-free packing hold
                    the same tokens), sdpa causal attention per row, the LM head and log-softmax in
                    float32 on the completion rows only, one backward per micro-batch
    keep, replay    ``TreeExecutor.backward`` over the whole forest (replay with
                    ``shape.block``-token blocks)
    packed          ``TreeExecutor(mode="packed")`` per call of whole groups (one forest per call:
                    a packed pass holds its whole forest's activations)
    prefix_grouper  ``prefix-grouper`` (benchmarks/prefix_grouper_compare.py's wiring) per call of
                    whole groups; inner attention on torch's flash kernel through sdpa with a
                    bottom-right causal bias (``prefix_grouper_flash``; GQA native where torch
                    takes it, ``FLASH_GQA`` says which), sdpa with a 4D mask when rows are padded
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .shapes import Batch, Shape


@dataclass
class Built:
    """Per method, the call to time; methods that could not be built, with the reason; notes."""

    runs: dict[str, Callable[[], object]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


def _executor(model, mode: str, shape: Shape):
    from forkrl.core.train import TreeOptions, TreeStep

    block = shape.block if mode == "replay" else None
    options = TreeOptions(tree_packing=True, tree_mode=mode, tree_block_size=block)
    ex = TreeStep(options).executor(model, mode)
    verify = getattr(ex, "verify", None)
    if verify is not None:
        verify()
    return ex


def _dense(model, batch: Batch, shape: Shape):
    from forkrl.core.estimate.pricing import dense_step

    tokens = shape.rows_per_micro_batch() * shape.row

    def run():
        return dense_step(model, batch.seqs, batch.score_from, batch.coefs, tokens, grad=True)

    return run


def _tree(model, batch: Batch, shape: Shape, mode: str):
    ex = _executor(model, mode, shape)

    def run():
        return ex.backward(batch.forest, batch.coefs)

    return run


def _packed(model, batch: Batch, shape: Shape):
    from forkrl.core import PrefixForest

    ex = _executor(model, "packed", shape)
    calls = [
        (PrefixForest.build(batch.seqs[sl], batch.score_from[sl]), batch.coefs[sl])
        for sl in batch.micro_batches(shape.groups_per_micro_batch())
    ]

    def run():
        for forest, coefs in calls:
            ex.backward(forest, coefs)

    return run


def _prefix_grouper(model, batch: Batch, shape: Shape, device) -> tuple[Callable[[], object], str]:
    from benchmarks.prefix_grouper_compare import PGBatch, pg_step, register_prefix_grouper

    register_prefix_grouper()
    calls = [
        PGBatch(batch.seqs[sl], batch.score_from[sl], batch.coefs[sl], device=device)
        for sl in batch.micro_batches(shape.groups_per_micro_batch())
    ]
    padded = any(c.padded for c in calls)
    # flash: torch's flash kernel on CUDA (the math fallback of the same call on the CPU, so --tiny
    # checks this path's gradient too)
    inner = "prefix_grouper_sdpa" if padded else "prefix_grouper_flash"

    def run():
        for call in calls:
            pg_step(model, call, inner=inner)

    return run, inner


def build(model, batch: Batch, shape: Shape, device, methods) -> Built:
    """Each method's call (module docstring); a method whose setup fails is skipped with its error."""
    built = Built()
    for m in methods:
        try:
            if m == "dense":
                built.runs[m] = _dense(model, batch, shape)
            elif m in ("keep", "replay"):
                built.runs[m] = _tree(model, batch, shape, m)
                if m == "keep":
                    built.notes[m] = _keep_note(model, device)
            elif m == "packed":
                built.runs[m] = _packed(model, batch, shape)
                from forkrl.core.executor import packed

                built.notes[m] = "FlexAttention BlockMask" if packed._use_flex(device) else "dense tree mask"
            elif m == "prefix_grouper":
                built.runs[m], inner = _prefix_grouper(model, batch, shape, device)
                built.notes[m] = f"prefix-grouper {_pg_version()}, inner attention {inner}"
            else:
                raise ValueError(f"unknown method {m!r}")
        except ImportError as err:
            built.skipped[m] = (
                f"{err}: carry the wheels of scripts/gpu_wheels.sh (carry=['build/gpu_wheels'])"
                if m == "prefix_grouper"
                else str(err)
            )
        except Exception as err:  # noqa: BLE001 - a method that cannot be built is a result, not a crash
            built.skipped[m] = f"{type(err).__name__}: {str(err)[:300]}"
    return built


def _keep_note(model, device) -> str:
    """Whether keep mode runs level-batched here (its kernels passed their check) or depth first."""
    from forkrl.core.attention import compute_dtype
    from forkrl.core.attention.level import level_kernels_for

    dtype = compute_dtype(device, next(model.parameters()).dtype)
    head_dim = getattr(model.config, "head_dim", None)
    return "level-batched" if level_kernels_for(device, dtype, head_dim) is not None else "depth first"


def _pg_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("prefix-grouper")
    except PackageNotFoundError:
        return None
