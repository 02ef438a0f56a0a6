"""The loop around the tree step that every host repeats, written once: :class:`TreeRunner`.

A plugin holds one runner (``self.forkrl = TreeRunner(options, host, ...)``) and, at the end of
each optimizer step's micro-batches, calls :meth:`TreeRunner.step` with them in its own type. What
is its host's it supplies through a :class:`HostAdapter`; the runner does the rest, in this order:

1. with several data-parallel ranks, the step's rows moved between them by predicted tree cost
   (:meth:`HostAdapter.rebalance`, priced by an :class:`~forkrl.core.balance.OnlineCostModel`
   fitted to every rank's measured steps);
2. the rows' layouts, images and token types (:meth:`HostAdapter.inputs`, where a host refuses
   what a batch holds) and the MoE router loss, one weight per micro-batch
   (:meth:`HostAdapter.router_weights`);
3. :meth:`TreeStep.train` with the host's loss (:meth:`HostAdapter.loss`) inside the host's
   context (:meth:`HostAdapter.context`: autocast, host patches off); on an engine that reduces
   gradients through hooks on the parameters (DeepSpeed, ``engine=True``) on an
   :class:`AliasReplica` of the model, whose gradient :meth:`HostAdapter.hand_over` then backs
   through the engine;
4. the ``tree/*`` figures combined over the ranks, the cost model's new samples and the
   ``tree/balance_*`` figures, handed to the host's sink (:meth:`HostAdapter.log`). Under an
   engine both come before the hand-over: no collective of forkrl's or the host's runs while the
   engine's reduction may be in flight.

Scoring (old-policy and reference log-probs) is :meth:`TreeStep.score` on :meth:`TreeRunner.tree`.

An adapter may inherit :class:`HostDefaults`, the answers most hosts give (one process, no router
loss, no engine, figures kept), and state only what differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from ..balance import CostModel, OnlineCostModel, Rebalanced, forest_stats
from ..errors import UnsupportedModelError
from ..executor import RouterLoss
from ..executor.vision import check_model as check_vision_model
from .options import TreeOptions
from .parallel import ParallelContext
from .sharded import AliasReplica
from .step import StepInputs, StepLoss, StepResult, TreeStep

__all__ = ["HostAdapter", "HostDefaults", "RunResult", "TreeRunner", "router_value"]

#: A host's micro-batch, in its own type (TRL's prepared inputs, OpenRLHF's ``Experience``, ...).
M = TypeVar("M")


class HostAdapter(Protocol[M]):
    """What a host supplies to :class:`TreeRunner` for one optimizer step's micro-batches.

    Every method takes the step's micro-batches in the host's own type (``window``). A host
    without rebalancing returns False from :meth:`balancing` and never sees :meth:`rebalance`; a
    host without an engine hand-over never sees :meth:`hand_over`. :class:`HostDefaults` answers
    every method but :meth:`inputs` and :meth:`loss` as most hosts do.
    """

    def parallel(self) -> ParallelContext:
        """The step's ranks, group and device."""
        ...

    def balancing(self, window: Sequence[M]) -> bool:
        """Whether this step's rows are moved between the data-parallel ranks (the same answer on
        every rank: the balancer is a collective)."""
        ...

    def rebalance(self, window: Sequence[M], cost: CostModel) -> tuple[list[M], Rebalanced]:
        """This rank's micro-batches after :func:`~forkrl.core.balance.rebalance` priced by ``cost``."""
        ...

    def inputs(self, window: Sequence[M]) -> StepInputs:
        """The micro-batches' layouts, images and token types (no router: the runner adds it).

        Raises:
            ValueError: for what the tree cannot take in these rows, naming the way out.
        """
        ...

    def router_weights(self, window: Sequence[M]) -> list[float] | None:
        """Per micro-batch, what the host's loss multiplies its router aux loss by; None without one."""
        ...

    def loss(self, window: Sequence[M], router: RouterLoss | None) -> StepLoss:
        """The host's loss of the step and its gradient kind; the loss may read ``router``'s values
        (:func:`router_value`)."""
        ...

    def context(self) -> AbstractContextManager:
        """The host's context around the tree's passes (its autocast, its patches turned off)."""
        ...

    def hand_over(self, replica: AliasReplica) -> None:
        """``engine=True``: back the step's gradient (``replica.gradient_surrogate()``) through the
        host's engine. Runs while the replica's parameters are whole; step the optimizer after."""
        ...

    def log(self, metrics: dict[str, float]) -> None:
        """The step's ``tree/*`` figures into the host's metrics. Under an engine it runs before
        :meth:`hand_over` (a host's own collectives after the step belong here, not after it)."""
        ...


class HostDefaults(Generic[M]):
    """The :class:`HostAdapter` answers most hosts give, for an adapter to inherit and override where
    its host differs; it states :meth:`~HostAdapter.inputs` and :meth:`~HostAdapter.loss` itself.

    Attributes:
        balance: rows move between the data-parallel ranks (:meth:`balancing`'s answer, decided
            once at setup so that every rank gives the same; a host that sets it overrides
            :meth:`rebalance`).
        metrics: the last step's figures, as :meth:`log` keeps them for the host to report.
    """

    balance: bool = False
    metrics: dict[str, float]

    def parallel(self) -> ParallelContext:
        """One process (or ranks that share nothing with the step), tensors on the model's device."""
        return ParallelContext()

    def balancing(self, window: Sequence[M]) -> bool:
        return self.balance

    def rebalance(self, window: Sequence[M], cost: CostModel) -> tuple[list[M], Rebalanced]:
        raise NotImplementedError(
            f"{type(self).__name__} moves no rows: it sets balance and overrides rebalance"
        )

    def router_weights(self, window: Sequence[M]) -> list[float] | None:
        """No router aux loss in the host's loss."""
        return None

    def context(self) -> AbstractContextManager:
        return nullcontext()

    def hand_over(self, replica: AliasReplica) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} hands no gradient to an engine: its runner is built with engine=False"
        )

    def log(self, metrics: dict[str, float]) -> None:
        """Keep the figures (:attr:`metrics`) for the host to report with its own."""
        self.metrics = dict(metrics)


@dataclass
class RunResult(Generic[M]):
    """What :meth:`TreeRunner.step` did.

    Attributes:
        result: the tree step's :class:`StepResult` (losses, this rank's figures, forest, objective).
        window: the micro-batches trained (after rebalancing: this rank's new share).
        metrics: the figures handed to :meth:`HostAdapter.log`.
    """

    result: StepResult
    window: list[M]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def loss(self) -> torch.Tensor:
        return self.result.loss


def router_value(router: RouterLoss | None, i: int, device: torch.device | str) -> torch.Tensor:
    """Micro-batch ``i``'s router aux loss value as a float32 scalar on ``device`` (zero without a
    router, or before its values are known): what a host's loss reads as ``aux_loss``. Its gradient
    is the tree's, so the value is a constant here."""
    values = router.values() if router is not None else None
    return (values[i] if values is not None else torch.zeros(())).to(device, torch.float32)


class TreeRunner(Generic[M]):
    """One host's tree training: the :class:`TreeStep` (executor cache), balancing and its cost
    model, the engine's replica, and the loop of :meth:`step`.

    Args:
        options: the tree options (a :class:`TreeOptions` or a host config inheriting them).
        host: the host's side (:class:`HostAdapter`).
        temperature: the host's sampling temperature (logits are divided by it).
        engine: the host's engine reduces gradients through hooks on the parameters (DeepSpeed):
            the tree trains an :class:`AliasReplica` and :meth:`HostAdapter.hand_over` backs its
            gradient through the engine.
        **step_kwargs: further :class:`TreeStep` arguments (``gather``, ``head_precision``, ...).
    """

    def __init__(
        self,
        options: TreeOptions,
        host: HostAdapter[M],
        temperature: float = 1.0,
        engine: bool = False,
        **step_kwargs: Any,
    ) -> None:
        self.options = options.tree_options()
        self.host = host
        self.engine = engine
        self.cost = OnlineCostModel()
        self._step_kwargs = step_kwargs
        self._trees = {float(temperature): TreeStep(self.options, temperature=temperature, **step_kwargs)}
        self._default = float(temperature)
        self._replica: AliasReplica | None = None

    # ------------------------------------------------------------------ the tree step
    def tree(self, temperature: float | None = None) -> TreeStep:
        """The :class:`TreeStep` for ``temperature`` (default: the runner's), built once."""
        key = self._default if temperature is None else float(temperature)
        if key not in self._trees:
            self._trees[key] = TreeStep(self.options, temperature=key, **self._step_kwargs)
        return self._trees[key]

    def check_model(self, model: nn.Module, way_out: str, vision: bool = False) -> None:
        """:meth:`TreeStep.check_model`, a refusal naming the host's ``way_out``; with ``vision`` (the
        host loaded a vision-language model) first :func:`~forkrl.core.executor.vision.check_model`
        on its base model (under a PEFT adapter)."""
        try:
            if vision:
                check_vision_model(getattr(model, "get_base_model", lambda: model)())
            self.tree().check_model(model, self.host.parallel())
        except UnsupportedModelError as err:
            raise err.for_host(way_out) from err

    def replica(self, model: nn.Module) -> AliasReplica:
        """The engine's replica of ``model`` (built once per model; DeepSpeed accumulates
        micro-batches in float32 for narrower parameters, so the tree does too)."""
        if self._replica is None or self._replica.model is not model:
            gather = self.tree().gather
            self._replica = AliasReplica(model, accumulate_dtype=torch.float32, gather=gather)
        return self._replica

    # ------------------------------------------------------------------ the loop
    def step(
        self,
        model: nn.Module,
        window: Sequence[M],
        gradient_checkpointing: bool = False,
        temperature: float | None = None,
    ) -> RunResult[M]:
        """Train one optimizer step's micro-batches as one forest (the module docstring's loop).

        Args:
            model: the unwrapped module the host trains.
            window: the step's micro-batches, in the host's type.
            gradient_checkpointing: the host's checkpointing flag (``tree_mode='auto'`` replays).
            temperature: the micro-batches' sampling temperature (default: the runner's).
        """
        host = self.host
        window, balanced = list(window), None
        if host.balancing(window):
            window, balanced = host.rebalance(window, self.cost.model)
        inputs = host.inputs(window)
        if inputs.images is not None and not any(inputs.images):
            inputs = replace(inputs, images=None, token_types=None)
        weights = host.router_weights(window)
        router = RouterLoss(weights) if weights is not None else None
        inputs = replace(inputs, router=router)
        loss = host.loss(window, router)
        parallel = host.parallel()
        if parallel.device is None:
            parallel = replace(parallel, device=next(model.parameters()).device)
        tree = self.tree(temperature)

        def train(target: nn.Module) -> StepResult:
            with host.context():
                return tree.train(target, inputs, loss, parallel, gradient_checkpointing)

        if not self.engine:
            result = train(model)
            metrics = self._metrics(result, balanced, parallel)
            host.log(metrics)
        else:
            replica = self.replica(model)
            with replica.whole():  # ZeRO-3: one all-gather for the step, the hand-over inside it
                with replica.gathered(grad=True) as plain:
                    result = train(plain)
                # forkrl's collectives (and the host's, in log) before the engine's backward: under
                # ZeRO-3 its reduction may still be in flight when it returns, until the optimizer
                # step, and a collective issued meanwhile was seen to read a half-reduced buffer.
                metrics = self._metrics(result, balanced, parallel)
                host.log(metrics)
                host.hand_over(replica)
                replica.clear()
        return RunResult(result, window, metrics)

    def _metrics(
        self, result: StepResult, balanced: Rebalanced | None, parallel: ParallelContext
    ) -> dict[str, float]:
        """The step's ``tree/*`` figures (combined over the ranks as ``parallel`` says) and, after
        a rebalanced step, the cost model's new samples and the ``tree/balance_*`` figures."""
        figures = result.metrics
        if not parallel.local_metrics:
            group = parallel.metrics_group if parallel.metrics_group is not None else parallel.group
            figures = figures.reduced(parallel.device, group=group)
        metrics = figures.as_dict()
        if balanced is not None:
            metrics["tree/balance_cost_fitted"] = float(self.cost.fitted)
            # Every rank's shape and time of this step: the next plans are priced by the refitted model.
            measured = self.cost.observe(
                forest_stats(result.forest),
                result.metrics.backward_time,
                group=parallel.group if parallel.balance_group is None else parallel.balance_group,
            )
            metrics.update(balanced.metrics(measured=measured))
        return metrics
