"""The host-neutral training step: one optimizer step's micro-batches trained as one forest.

A plugin keeps only what is its host's: where it collects a step's micro-batches, how the tree's
leaves reach its loss, whether its loss gradient is value-independent, its refusals, its metric
sink. Everything else is here, once:

1. rows in the host's layout -> :class:`~forkrl.core.tree.RowLayout` (built by the plugin with
   ``RowLayout.padded`` / ``packed``) -> one :class:`~forkrl.core.tree.Window` -> one forest;
2. the executor mode for that forest (:meth:`TreeOptions.mode_for`) and the executor, cached per
   model and mode;
3. prefix-shared no-grad scoring returned in the host's layout (:meth:`TreeStep.score`: old and
   reference log-probs);
4. the backward through the host's own loss on leaves in the host's layout, per micro-batch
   (:func:`~forkrl.core.objective.backward_window`: fused when the host says its gradient is
   value-independent and the probe agrees, two passes otherwise);
5. the data-parallel gradient average (:func:`all_reduce_gradients`);
6. the NaN/inf check before anything is accumulated (in the bridge);
7. the ``tree/*`` metrics the host forwards to its logger (:class:`StepMetrics`).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..executor import MODES, ContextParallelExecutor, ExecMode, Image, RouterLoss, TreeExecutor, VisionBatch
from ..objective import LossGradient, Quiet, WindowLoss, WindowResult, backward_window
from ..tree import PrefixForest, RowLayout, Window
from .distributed import all_reduce_gradients, reduce_stats
from .options import TreeOptions
from .parallel import ParallelContext, agreed
from .sharded import AliasReplica, FSDP2Replica, Gather, is_fsdp2, is_zero3
from .union import GroupRows

__all__ = ["MODE_CODES", "Images", "StepInputs", "StepLoss", "StepMetrics", "StepResult", "TreeStep"]

#: Per row of a window, its images in order (a vision-language model; empty for a text row).
Images = Sequence[Sequence[Image]]

#: ``tree/mode`` is logged as a number (hosts average metrics): keep 0, replay 1, packed 2.
MODE_CODES = {mode: i for i, mode in enumerate(MODES)}


@dataclass
class StepInputs:
    """One optimizer step's rows, as :meth:`TreeStep.train` takes them.

    Attributes:
        window: the step's micro-batches, each a :class:`RowLayout` of the host's rows.
        images: per row of the window (in order), its images (a vision-language model: each
            unique image through the vision tower once, :mod:`forkrl.core.executor.vision`).
        token_types: per row, ``[T_i]`` which of its tokens are image placeholders (the
            processor's ``mm_token_type_ids``; None: placeholders found by id).
        router: the MoE router load-balancing loss, one weight per micro-batch (bound here to the
            step's forest); the loss may read ``router.values()`` (:mod:`forkrl.core.executor.router`).
    """

    window: Window | Sequence[RowLayout]
    images: Images | None = None
    token_types: Sequence[torch.Tensor] | None = None
    router: RouterLoss | None = None

    @property
    def layouts(self) -> Window:
        """The micro-batches as one :class:`Window`."""
        if not isinstance(self.window, Window):
            self.window = Window(self.window)
        return self.window


@dataclass
class StepLoss:
    """The host's loss over one step, and what the bridge may assume about its gradient.

    Attributes:
        fn: ``(i, logprobs, entropies) -> scalar``: the host's loss of micro-batch ``i`` on tensors
            of its layout, scaled as the host scales it before backward.
        gradient: ``"constant"`` when the host knows its loss gradient cannot depend on the values
            (probed before use; after one disagreement the step object stops trying),
            ``"token_local"``, or ``"general"``.
        entropy: the loss reads entropies.
        quiet: a context in which ``fn`` has no side effects (for the probes).
    """

    fn: WindowLoss
    gradient: LossGradient = "general"
    entropy: bool = True
    quiet: Quiet | None = None


@dataclass
class StepMetrics:
    """Figures of one tree step (this rank's; :meth:`reduced` combines ranks).

    Attributes:
        unique_tokens: tokens the forest computes (each shared token once).
        dense_tokens: tokens of the rows as independent sequences.
        mode: the executor mode.
        backward_time: seconds in the tree backward pass.
        score_time: seconds in tree scoring since the previous step (old/reference log-probs and
            the step's own scoring pass).
    """

    unique_tokens: float
    dense_tokens: float
    mode: str
    backward_time: float
    score_time: float

    def reduced(self, device: torch.device | str = "cpu", group=None) -> StepMetrics:
        """Token counts summed and times maxed over the ranks of ``group`` (the step's global figures)."""
        (unique, dense), (bwd, score) = reduce_stats(
            [self.unique_tokens, self.dense_tokens],
            [self.backward_time, self.score_time],
            torch.device(device),
            group,
        )
        return StepMetrics(unique, dense, self.mode, bwd, score)

    def as_dict(self, prefix: str = "tree/") -> dict[str, float]:
        """Scalars for a host's metrics dict: compression, unique/dense tokens, mode code, times."""
        return {
            f"{prefix}compression": self.dense_tokens / max(self.unique_tokens, 1.0),
            f"{prefix}unique_tokens": float(self.unique_tokens),
            f"{prefix}dense_tokens": float(self.dense_tokens),
            f"{prefix}mode": float(MODE_CODES[self.mode]),
            f"{prefix}backward_time": float(self.backward_time),
            f"{prefix}score_time": float(self.score_time),
        }


@dataclass
class StepResult:
    """Outcome of :meth:`TreeStep.train`.

    Attributes:
        losses: one detached scalar per micro-batch (the host's loss).
        metrics: this rank's :class:`StepMetrics`.
        forest: the step's forest.
        objective: the bridge's result (values, path that ran).
    """

    losses: list[torch.Tensor]
    metrics: StepMetrics
    forest: PrefixForest
    objective: WindowResult

    @property
    def loss(self) -> torch.Tensor:
        return torch.stack(self.losses).sum()


class TreeStep:
    """Trains a host's optimizer steps as prefix forests and scores its log-prob requests.

    One per trainer (it caches executors and remembers whether the fused path applies).

    Args:
        options: the tree options (a :class:`TreeOptions` or a host config inheriting them).
        temperature: the host's sampling temperature (logits are divided by it).
        gather: the engine's context that makes partitioned parameters whole (DeepSpeed ZeRO-3:
            :func:`forkrl.plugins.deepspeed.gathered`), for scoring such a model; see
            :class:`AliasReplica`.
        **executor_kwargs: further :class:`TreeExecutor` arguments (``head_chunk_elems``, ...).
    """

    def __init__(
        self, options: TreeOptions, temperature: float = 1.0, gather: Gather | None = None, **executor_kwargs
    ) -> None:
        self.options = options.tree_options()
        self.gather = gather
        self.temperature = temperature
        self.executor_kwargs = executor_kwargs
        self._executors: dict[tuple, tuple[weakref.ref, TreeExecutor | ContextParallelExecutor]] = {}
        self._replicas: dict[int, FSDP2Replica | AliasReplica] = {}
        self.fused_ok = True
        self._score_time = 0.0

    # ------------------------------------------------------------------ executors
    def executor(
        self, model: nn.Module, mode: ExecMode, parallel: ParallelContext | None = None
    ) -> TreeExecutor | ContextParallelExecutor:
        """The executor for ``model`` (the unwrapped module) in ``mode``, built once; with
        ``long_context_replay`` and a ``parallel.context_parallel`` group, the prompts are split
        over that group (:class:`ContextParallelExecutor`)."""
        group = self._group(parallel)
        rows = parallel.context_parallel_rows if group is not None else None
        key = (id(model), mode, id(group) if group is not None else None, rows)
        entry = self._executors.get(key)
        if entry is None or entry[0]() is not model:
            kwargs = {**self.options.executor_kwargs(mode), **self.executor_kwargs}
            if group is not None:
                kwargs = {k: kwargs[k] for k in ("block_size", "prompt_grad")}
                built = ContextParallelExecutor(
                    model, group, temperature=self.temperature, rows=rows, **kwargs
                )
            else:
                built = TreeExecutor(model, temperature=self.temperature, **kwargs)
            entry = self._executors[key] = (weakref.ref(model), built)
        return entry[1]

    def _group(self, parallel: ParallelContext | None):
        """The context-parallel group prompts are split over (None: each rank alone)."""
        return (
            parallel.context_parallel if parallel is not None and self.options.long_context_replay else None
        )

    def _union(self, layouts: Sequence[RowLayout], parallel: ParallelContext | None) -> GroupRows | None:
        """The group's union of micro-batches where its ranks hold their own rows (one collective)."""
        group = self._group(parallel)
        if group is None or parallel.context_parallel_rows != "own":
            return None
        return GroupRows.gather(layouts, group)

    def _path(self, gradient: LossGradient, parallel: ParallelContext) -> LossGradient:
        """The bridge's path for a loss whose gradient is ``gradient``."""
        if gradient == "constant" and not self.fused_ok:
            return "general"
        if self._group(parallel) is None:
            return gradient
        if gradient == "token_local":
            return "general"  # coefficients formed during the pass need one device's pass: score first
        if gradient == "constant" and parallel.context_parallel_rows == "own":
            return "general"  # each rank probes its own loss: one path for all needs no probe
        return gradient

    def check_model(self, model: nn.Module, parallel: ParallelContext | None = None) -> None:
        """Raise :class:`~forkrl.core.UnsupportedModelError` now for a model no tree can run (with
        ``parallel.context_parallel``, also one whose prompts cannot be split over the group)."""
        replica = self._replica(model)
        target = replica.replica if replica is not None else model
        # With a context-parallel group the executor that will run (it checks the model as it is built).
        executor = self.executor(target, self.score_mode, parallel)
        executor.adapter.check_deterministic()
        # A sharded model's probe waits for its first gathered pass; the context-parallel one has none.
        if replica is None and isinstance(executor, TreeExecutor):
            executor.verify()
        if self.options.tree_mode == "packed":
            self.executor(target, "packed")

    def _replica(self, model: nn.Module) -> FSDP2Replica | AliasReplica | None:
        """The gathered replica of an FSDP2-sharded or ZeRO-3-partitioned model (built once), or
        None for a plain one."""
        if not (is_fsdp2(model) or is_zero3(model)):
            return None
        entry = self._replicas.get(id(model))
        if entry is None or entry.model is not model:
            built = FSDP2Replica(model) if is_fsdp2(model) else AliasReplica(model, gather=self.gather)
            entry = self._replicas[id(model)] = built
        return entry

    @staticmethod
    def _agreed(run, device: torch.device, group, collective: bool, consequence: str = ""):
        """``run()``, with a failure on any rank raised on every rank before the gradient
        collectives that follow (no rank is left waiting in them): :func:`agreed`."""
        if not collective:
            return run()
        elsewhere = RuntimeError(
            "another data-parallel rank stopped this step before the gradients were reduced (see that rank's "
            f"error); {consequence}"
        )
        return agreed(run, device, elsewhere, group, catch=(ValueError, TypeError, RuntimeError))

    @property
    def score_mode(self) -> ExecMode:
        return "replay" if self.options.long_context_replay else "keep"

    # ------------------------------------------------------------------ the two entry points
    def score(
        self,
        model: nn.Module,
        layout: RowLayout,
        entropy: bool = False,
        images: Images | None = None,
        token_types: Sequence[torch.Tensor] | None = None,
        parallel: ParallelContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prefix-shared no-grad log-probs (and entropies) of one micro-batch, in its host layout.

        Args:
            images: per row, its images (a vision-language model, :mod:`forkrl.core.executor.vision`).
            token_types: per row, which of its tokens are image placeholders (:meth:`score_window`).
            parallel: the host's ranks; its ``context_parallel`` group splits long prompts.

        Returns:
            Tensors of ``layout.shape`` on the model's device, zeros at unscored slots.
        """
        return self.score_window(model, [layout], entropy, images, token_types, parallel)[0]

    def score_window(
        self,
        model: nn.Module,
        window: Window | Sequence[RowLayout],
        entropy: bool = False,
        images: Images | None = None,
        token_types: Sequence[torch.Tensor] | None = None,
        parallel: ParallelContext | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`score` for several micro-batches at once: one forest over all their rows, so
        prefixes shared across micro-batches are computed once too.

        Args:
            images: per row of the window (in order), its images.
            token_types: per row, ``[T_i]`` which tokens are image placeholders (the processor's
                ``mm_token_type_ids`` over the row's tokens; see :meth:`VisionBatch.prepare`).

        Returns:
            Per micro-batch, its log-probs and entropies (or None) in its layout's shape.
        """
        start = time.perf_counter()
        window = window if isinstance(window, Window) else Window(window)
        union = self._union(window.layouts, parallel)
        if union is not None:
            window = union.window
        replica = self._replica(model)
        with replica.gathered(grad=False) if replica is not None else contextlib.nullcontext(model) as target:
            executor = self.executor(target, self.score_mode, parallel)
            vision, forest = _forest(target, StepInputs(window, images, token_types), grad=False)
            res = executor.score(forest, entropy=entropy, vision=vision)
            device = executor.device  # a replica's parameters are freed on exit
        lps = window.flat(res.logprobs)
        ents = window.flat(res.entropies) if entropy else [None] * len(window)
        out = []
        for lay, lp, ent in zip(window.layouts, lps, ents, strict=True):
            out.append((lay.to_host(lp.to(device)), lay.to_host(ent.to(device)) if ent is not None else None))
        self._score_time += time.perf_counter() - start
        return union.own(out) if union is not None else out

    def train(
        self,
        model: nn.Module,
        inputs: StepInputs | Window | Sequence[RowLayout],
        loss: StepLoss | WindowLoss,
        parallel: ParallelContext | None = None,
        gradient_checkpointing: bool = False,
    ) -> StepResult:
        """Accumulate the exact gradient of one optimizer step's host loss into ``param.grad``.

        Args:
            model: the unwrapped module the host trains (a DDP wrapper's hooks would not fire).
            inputs: the step's micro-batches and what comes with their rows (:class:`StepInputs`),
                or just the micro-batches (a :class:`Window` or its :class:`RowLayout` list).
            loss: the host's loss and how its gradient behaves (:class:`StepLoss`), or just its
                function (a general gradient that reads entropies).
            parallel: the host's ranks (:class:`ParallelContext`); None: a single process, leaves on
                the model's device.
            gradient_checkpointing: the host's checkpointing flag (``tree_mode='auto'`` then replays).

        Returns:
            :class:`StepResult`: the losses, this rank's metrics, the forest.
        """
        inputs = inputs if isinstance(inputs, StepInputs) else StepInputs(inputs)
        loss = loss if isinstance(loss, StepLoss) else StepLoss(loss)
        parallel = parallel or ParallelContext()
        union = self._union(inputs.layouts.layouts, parallel)
        if union is not None:
            inputs = replace(inputs, window=union.window)
            loss = replace(loss, fn=union.loss(loss.fn))
        window, router = inputs.layouts, inputs.router
        forest = window.forest() if inputs.images is None else None  # with images: built once prepared
        if router is not None and forest is not None:
            router.bind(forest, window.rows)
        mode = self.options.mode_for(max(map(len, window.sequences)), gradient_checkpointing)
        path = self._path(loss.gradient, parallel)
        replica = self._replica(model)
        if isinstance(replica, AliasReplica):
            raise ValueError(
                "TreeStep.train: this model's parameters are DeepSpeed ZeRO-3 partitions, whose gradients only "
                "the engine reduces: train AliasReplica(model).gathered(grad=True)'s replica inside "
                "AliasReplica.whole() and backward its gradient_surrogate() through the engine there"
            )
        # Under FSDP2 the step runs on a gathered plain replica, which reduces its gradients on exit.
        with replica.gathered(grad=True) if replica is not None else contextlib.nullcontext(model) as target:
            executor = self.executor(target, mode, parallel)
            built: list = [forest]

            def run() -> WindowResult:
                vision = None
                if inputs.images is not None:  # inside the agreement: a bad image fails on every rank
                    vision, built[0] = _forest(target, inputs, grad=True)
                    if router is not None:
                        router.bind(built[0], window.rows)
                with executor.images(vision):
                    return backward_window(
                        executor,
                        built[0],
                        window,
                        loss.fn,
                        path,
                        entropy=loss.entropy,
                        quiet=loss.quiet,
                        device=parallel.device,
                        router=router,
                    )

            res = self._agreed(
                run,
                executor.device,
                parallel.group,
                collective=replica is not None or parallel.collective,
                consequence="the model's sharded gradients are unchanged on every rank"
                if replica is not None
                else "this rank's param.grad holds its own part of the step, not reduced: zero the gradients "
                "before retrying"
                if parallel.average_gradients
                else "nothing was handed to the engine: its gradients are unchanged on every rank",
            )
        forest = built[0]
        if path == "constant" and res.path != "constant":
            self.fused_ok = False
        if parallel.average_gradients and replica is None:
            all_reduce_gradients(model.parameters(), group=parallel.group)
        score_time, self._score_time = self._score_time + res.score_time, 0.0
        losses, share = res.losses, 1
        if union is not None:  # this rank's losses; its share of the union's tokens, so that ranks sum
            losses, share = union.own(res.losses), union.ranks
        metrics = StepMetrics(
            forest.unique_tokens / share, forest.dense_tokens / share, mode, res.backward_time, score_time
        )
        return StepResult(losses, metrics, forest, res)


def _forest(model: nn.Module, inputs: StepInputs, grad: bool):
    """``(vision, forest)`` of a step's rows: without images ``(None, window.forest())``; with them
    the images prepared (:class:`VisionBatch`) and the forest built from its sequences."""
    window, images = inputs.layouts, inputs.images
    if images is None:
        return None, window.forest()
    if len(images) != len(window.sequences):
        raise ValueError(f"images for {len(images)} rows, but the window has {len(window.sequences)}")
    vision = VisionBatch.prepare(model, window.sequences, images, grad=grad, token_types=inputs.token_types)
    return vision, PrefixForest.build(vision.sequences, window.score_from)
