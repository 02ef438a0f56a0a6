"""forkrl's ActorPPOTrainer: OpenRLHF's actor trainer with each optimizer step run as one prefix forest.

OpenRLHF's ``ppo_train`` groups the replay buffer's micro-batches into optimizer-step windows
(``iter_grad_accum_global_norm``: ``accumulated_gradient`` micro-batches sharing global loss
normalisers; with dynamic batching, the buffer's ``dynamic_optimizer_step`` marks the ends) and
calls ``training_step`` per micro-batch. Here, at a window's first micro-batch, the whole window
becomes one forest (shared prompts found by tokens: the buffer's shuffle has scattered the groups)
and the trainer's :class:`forkrl.core.train.TreeRunner` (``self.forkrl``; OpenRLHF's side of it is
:class:`OpenRLHFHost`) trains it:

- the loss is OpenRLHF's own: ``ActorPPOTrainer.training_step`` runs per micro-batch with the actor
  replaced by the tree's log-probs/entropies (leaves, ``[B, num_actions]``) and ``strategy.backward``
  capturing the loss instead of running it (``PolicyLoss``, KL, entropy, ``aggregate_loss``, the
  window's normalisers, its metrics: all unchanged);
- the tree runs on an :class:`~forkrl.core.train.AliasReplica` of the DeepSpeed module (its
  parameters aliased: whole under ZeRO 0-2, gathered once for the window under ZeRO-3), so
  DeepSpeed's gradient hooks do not fire during the tree's many backwards; then each micro-batch's
  ``training_step`` call backs a surrogate through DeepSpeed's own ``engine.backward`` (the window's
  gradient at the first, zero at the others, so DeepSpeed's loss scaling by
  ``1 / accumulated_gradient``, reduction and accumulation boundary run as in stock) and steps
  exactly where stock steps. Under ZeRO-3 the first hand-over runs while the window's gather is
  still open (one all-gather and one reduce-scatter per window), and the later ones reach no
  parameter.

With several data-parallel ranks (``--forkrl.tree_balance auto``, the default), each window's rows
are first moved between the ranks by predicted tree cost (:mod:`forkrl.plugins.openrlhf.balance`).

Under ring attention (``--ds.ring_attn_size R > 1``) OpenRLHF gives every rank of a ring group the
same micro-batches and splits each sequence over the group. The tree runs whole sequences, so the
group divides each window instead: rank ``s`` trains a contiguous run of the window's micro-batches
(:func:`forkrl.core.train.share_micro_batches`) with ``R`` times their loss, and the statuses are
all-gathered so that every rank reports every micro-batch. DeepSpeed averages the gradients over
all ranks, and stock's ring ranks each hold ``R`` times their slice's gradient (the log-probs'
all-gather reduce-scatters its gradient), so the update is stock's for any loss: each micro-batch
keeps its rows and normalisers. A window with fewer micro-batches than ``R`` runs whole on every rank.
With ``--forkrl.long_context_replay`` the group splits each prompt instead
(:class:`forkrl.core.executor.ContextParallelExecutor`): every rank runs the whole window, keeps
``1/R`` of each prompt's cache and computes its pieces of it, and ends with the window's whole
gradient (DeepSpeed's average is then stock's); scoring likewise returns every row on every rank.

Old-policy and reference log-probs go through :func:`score_log_probs` (prefix-shared, no grad; under
ring attention each rank of the group scores its share of the rows, :func:`ring_share`).

A vision-language actor (``Actor.is_vlm``: the Qwen-VL family, LLaVA, LLaVA-NeXT, Gemma 3) trains
and scores with its images on the tree: each sample's ``Experience.mm_train_inputs`` (its processor's
outputs) becomes that row's :class:`~forkrl.core.executor.Image` list (:func:`row_images`), each
unique image runs through the vision tower once per pass, and the placeholders are found by the
model's ``image_token_id``, as ``Actor.forward`` finds them. Video, packed samples, ring attention,
rebalancing and other model families are refused (:func:`~.options.check_vlm_args`).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from openrlhf.trainer.ray import ppo_actor
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

from forkrl.core import RowLayout, TreeStep
from forkrl.core.balance import CostModel, Rebalanced
from forkrl.core.executor import Image, RouterLoss
from forkrl.core.executor.vision import processor_images
from forkrl.core.train import (
    AliasReplica,
    HostDefaults,
    ParallelContext,
    StepInputs,
    StepLoss,
    TreeRunner,
    agreed,
    gather_shares,
    router_value,
    share_micro_batches,
    world_size,
)

from ..deepspeed import gathered
from . import compat
from .balance import balance_window
from .options import balance_setting, check_host_args, check_vlm_args, options_from

__all__ = [
    "OpenRLHFHost",
    "TreeActorPPOTrainer",
    "ring_share",
    "row_images",
    "score_log_probs",
    "tree_module",
]

#: A micro-batch of a window: OpenRLHF's ``Experience`` and its ``loss_batch_info`` (None under dynamic batching).
MicroBatch = tuple[Any, "dict | None"]

#: The way out named by a refusal of a sample's images.
_WAY_OUT = "drop --forkrl.tree_packing (and --forkrl.long_context_replay) for this model"


def tree_module(actor: torch.nn.Module) -> torch.nn.Module:
    """The module the tree runs: the transformers model inside the Actor's DeepSpeed engine."""
    engine = compat.engine_of(actor)
    return getattr(engine, "module", engine)


def _layout(sequences: torch.Tensor, action_mask: torch.Tensor, attention_mask: torch.Tensor) -> RowLayout:
    """OpenRLHF's rows: ``[B, T]`` sequences (real tokens one run per row), ``[B, num_actions]``
    per-token tensors over the last ``num_actions`` columns, scored from the first action."""
    return RowLayout.padded(sequences, attention_mask, int(action_mask.shape[1]), response_mask=action_mask)


def _samples(mm_train_inputs: Any) -> list:
    """OpenRLHF's multimodal field flattened to one entry (a dict or None) per sample: a micro-batch's
    ``Experience.mm_train_inputs`` is already that; an actor's ``mm_train_inputs_list`` may nest it
    (a list per ``Samples``), as ``merge_mm_train_inputs`` accepts."""
    out: list = []
    for entry in mm_train_inputs or []:
        out.extend(_samples(entry) if isinstance(entry, (list, tuple)) else [entry])
    return out


def row_images(mm_train_inputs: Sequence | None, rows: int) -> list[list[Image]] | None:
    """Per row, its images from OpenRLHF's per-sample processor outputs; None when no row has any.

    Args:
        mm_train_inputs: ``Experience.mm_train_inputs`` (one dict or None per row) or an actor's
            ``mm_train_inputs_list`` (the same, possibly nested per ``Samples``). A dict holds
            ``pixel_values`` (Qwen-VL: ``[patches, d]``, split per image by ``image_grid_thw``
            ``[images, 3]``, ``prod(grid)`` rows each; LLaVA: ``[images, C, H, W]``; LLaVA-NeXT:
            ``[images, crops, C, H, W]`` with ``image_sizes`` ``[images, 2]``).
        rows: the micro-batch's row count ``B``.

    Raises:
        UnsupportedModelError: for video or processor outputs the tree does not take.
        ValueError: when the samples do not match the rows, or a grid its pixels.
    """
    samples = _samples(mm_train_inputs)
    if not any(sample is not None and len(sample) > 0 for sample in samples):
        return None
    if len(samples) != rows:
        raise ValueError(f"mm_train_inputs holds {len(samples)} samples for {rows} rows; {_WAY_OUT}")
    return [processor_images(s, f"sample {i}", "mm_train_inputs", _WAY_OUT) for i, s in enumerate(samples)]


def ring_share(
    sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int, size: int, rank: int
) -> list[int] | None:
    """The rows rank ``rank`` of a ring-attention group of ``size`` scores, when the group's ranks,
    which all receive the same batch, divide it instead of each scoring all of it.

    Rows that share a prompt stay together where there are at least ``size`` prompts (the
    experience maker keeps a prompt's samples contiguous: a group is a run of equal prompts);
    prompts, or else rows, go to the ranks in contiguous runs cut by token count
    (:func:`~forkrl.core.train.share_micro_batches`).

    Args:
        sequences: ``[B, T]`` token ids and ``attention_mask`` ``[B, T]``, on the host; the last
            ``num_actions`` columns are the responses.

    Returns:
        Row indices, or None when the batch has fewer rows than ranks (every rank scores all).
    """
    prompts = (sequences * attention_mask)[:, : sequences.shape[1] - num_actions]
    tokens = attention_mask.sum(-1).tolist()
    runs: list[list[int]] = []
    for i in range(len(tokens)):
        if runs and torch.equal(prompts[i], prompts[runs[-1][0]]):
            runs[-1].append(i)
        else:
            runs.append([i])
    units = runs if len(runs) >= size else [[i] for i in range(len(tokens))]
    picked = share_micro_batches([sum(tokens[i] for i in unit) for unit in units], size, rank)
    return None if picked is None else [i for u in picked for i in units[u]]


@torch.no_grad()
def score_log_probs(
    tree: TreeStep,
    module: torch.nn.Module,
    sequences: torch.Tensor,
    action_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    images: Sequence[Sequence[Image]] | None = None,
) -> torch.Tensor:
    """``Actor.forward``'s action log-probs, prefix-shared: ``[B, num_actions]``, zero where
    ``action_mask`` is 0, on the CPU (as OpenRLHF's actors return them).

    Under ring attention every rank of a ring group receives the same batch (OpenRLHF splits each
    sequence over the group and all-gathers the log-probs; the experience maker reads the group's
    first rank): here each rank scores its share of the rows (:func:`ring_share`) and the group
    sums the shares, each row nonzero on one rank only, so every rank returns the whole batch.

    Args:
        sequences: ``[B, T]`` token ids; ``attention_mask`` ``[B, T]``; ``action_mask`` ``[B, num_actions]``
            (on the host, as OpenRLHF's actors receive them, or on the model's device).
        images: per row, its images (a vision-language model, :func:`row_images`), or None.
    """
    ring = compat.ring_group()
    split = (
        ring if ring is not None and tree.options.long_context_replay else None
    )  # each prompt over the group
    rows = None
    if ring is not None and images is None and split is None:  # a VLM actor is refused under ring attention
        size, rank = dist.get_world_size(ring), dist.get_rank(ring)
        rows = ring_share(sequences.cpu(), attention_mask.cpu(), int(action_mask.shape[1]), size, rank)
    if rows is not None:
        mine = tuple(t[torch.tensor(rows, device=t.device)] for t in (sequences, action_mask, attention_mask))
    else:
        mine = (sequences, action_mask, attention_mask)
    layout = _layout(*mine)
    was_training = module.training
    module.eval()
    try:
        with compat.ring_attention_off():  # the tree computes whole sequences on each rank
            logps, _ = tree.score(
                module,
                layout,
                images=images,
                parallel=ParallelContext(context_parallel=split) if split is not None else None,
            )
    finally:
        module.train(was_training)
    if rows is not None:
        whole = logps.new_zeros(action_mask.shape)
        whole[torch.tensor(rows, device=logps.device)] = logps
        dist.all_reduce(whole, group=ring)  # x + 0 is x: the sum is each row's own log-probs
        logps = whole
    return (logps * action_mask.to(logps.device).float()).cpu()


def _moved(x: Any, where: torch.device | str) -> Any:
    """``x`` (a status: dicts, lists, tensors, numbers) with its tensors on ``where``."""
    if isinstance(x, torch.Tensor):
        return x.to(where)
    if isinstance(x, dict):
        return {k: _moved(v, where) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_moved(v, where) for v in x)
    return x


def _gather_statuses(statuses: list, mine: list[int], group, device: torch.device) -> list[dict]:
    """The ring group's ``training_step`` statuses, each rank's own at its micro-batches' indices."""
    own = [(i, _moved(statuses[i], "cpu")) for i in mine]
    return [_moved(status, device) for status in gather_shares(own, len(statuses), group)]


class _LeafActor:
    """Stands in for the ``Actor`` inside OpenRLHF's loss code: returns the tree's leaves."""

    def __init__(
        self,
        actor: torch.nn.Module,
        logps: torch.Tensor,
        entropies: torch.Tensor | None,
        aux_loss: torch.Tensor | None = None,
    ) -> None:
        self._actor, self._logps, self._entropies, self._aux = actor, logps, entropies, aux_loss

    def __call__(self, sequences, action_mask, attention_mask=None, return_output=False, **kwargs):
        if tuple(self._logps.shape) != tuple(action_mask.shape):
            raise RuntimeError(
                f"tree step: the loss asked for log-probs of shape {tuple(action_mask.shape)} but the micro-batch's "
                f"leaves have {tuple(self._logps.shape)}"
            )
        logps = self._logps * action_mask.float()  # as Actor.forward returns them
        # [B, num_actions] entropies: the host's [:, -num_actions:] slice of them is the identity.
        # The MoE router loss's value: its gradient is the tree's (a constant here).
        output = SimpleNamespace(entropy=self._entropies, aux_loss=self._aux)
        return (logps, output) if return_output else logps

    def train(self, mode: bool = True) -> _LeafActor:
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._actor, name)


class _LossCapture:
    """Stands in for the strategy inside OpenRLHF's loss code: keeps the loss, defers the rest."""

    def __init__(self, strategy: Any) -> None:
        self._strategy, self.loss = strategy, None

    def backward(self, loss: torch.Tensor, model: Any, optimizer: Any, **kwargs: Any) -> None:
        self.loss = loss

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def moving_average(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_grad_norm(self, model: Any) -> float:
        return 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy, name)


class TreeActorPPOTrainer(ActorPPOTrainer):
    """OpenRLHF's ``ActorPPOTrainer``; with ``--forkrl.tree_packing`` each optimizer step is one forest.

    Built by OpenRLHF's ``PolicyModelActor`` in place of its own trainer (same arguments); forkrl's
    options come from ``strategy.args.forkrl`` (attached by the launcher). Without them it is stock.
    """

    def __init__(self, strategy: Any, actor: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(strategy, actor, *args, **kwargs)
        self.tree_options = options_from(strategy.args)
        # forkrl's tree training (None: off): the loop around the tree step, with OpenRLHF's side.
        self.forkrl: TreeRunner[MicroBatch] | None = None
        if self.tree_options.tree_enabled:
            check_host_args(strategy.args, self.tree_options)
            # DeepSpeed reduces through hooks on the parameters: the tree trains a replica aliasing them.
            self.forkrl = TreeRunner(
                self.tree_options,
                OpenRLHFHost(self),
                temperature=float(getattr(actor, "temperature", 1.0)),
                engine=True,
                gather=gathered,
            )
            self._check_setup()
            self.forkrl.host.balance = balance_setting(
                strategy.args, self.tree_options, world_size(), vlm=self._is_vlm
            )

    @property
    def tree_step(self) -> TreeStep | None:
        """The tree scorer (the policy actor's old log-probs); None without tree training."""
        return None if self.forkrl is None else self.forkrl.tree()

    def _check_setup(self) -> None:
        flag = "--forkrl.tree_packing" if self.tree_options.tree_packing else "--forkrl.long_context_replay"
        if self._is_vlm:
            check_vlm_args(self.strategy.args, self.tree_options)
        self.forkrl.check_model(tree_module(self.actor), f"train without {flag}", vision=self._is_vlm)

    @property
    def _is_vlm(self) -> bool:
        """Whether OpenRLHF loaded the actor as a vision-language model (``Actor.is_vlm``)."""
        return bool(getattr(self.actor, "is_vlm", False))

    # ------------------------------------------------------------------ OpenRLHF hooks
    def ppo_train(self, kl_ctl: float):
        """OpenRLHF's loop; with tree training its optimizer-step windows are recorded as they form."""
        if self.forkrl is None:
            return super().ppo_train(kl_ctl)
        host, tree = ppo_actor.iter_grad_accum_global_norm, self.forkrl.host

        def windows(data_iter, strategy, accumulated_gradient, mask_fn) -> Iterator[tuple[Any, dict]]:
            items = host(data_iter, strategy, accumulated_gradient, mask_fn)
            gas = max(int(accumulated_gradient), 1)
            while chunk := list(itertools.islice(items, gas)):  # the host yields whole windows of gas
                tree.window, tree.start, tree.statuses = chunk, -1, []
                yield from chunk

        with compat.swapped(ppo_actor, iter_grad_accum_global_norm=windows):
            return super().ppo_train(kl_ctl)

    def training_step(self, experience, kl_ctl: float, step: int, loss_batch_info: dict | None = None):
        """OpenRLHF's step without tree training; otherwise micro-batch ``step`` of its window."""
        if self.forkrl is None:
            return super().training_step(experience, kl_ctl, step, loss_batch_info)
        i = self._position(experience, step)
        if i == 0:
            self._train_window(kl_ctl)
        return self._finish(i, step)

    # ------------------------------------------------------------------ the window
    def _position(self, experience: Any, step: int) -> int:
        """Index of this micro-batch in its window (building the window under dynamic batching)."""
        tree = self.forkrl.host
        if self.args.train.dynamic_batch_enable:
            ends = self.replay_buffer.dynamic_optimizer_step
            if step == 0 or ends[step - 1]:
                stop = next(j for j in range(step, len(ends)) if ends[j]) + 1
                buffer = self.replay_buffer
                tree.window = [(buffer.collate_fn([buffer[j]]), None) for j in range(step, stop)]
                tree.start, tree.statuses = step, []
            if not tree.window or not 0 <= step - tree.start < len(tree.window):
                raise RuntimeError(
                    f"tree step: micro-batch {step} is outside the recorded optimizer-step window"
                )
            return step - tree.start
        for i, (item, _) in enumerate(tree.window):
            if item is experience:
                if i == 0:
                    tree.start = step
                return i
        raise RuntimeError(
            "tree step: training_step was called with a micro-batch outside ppo_train's optimizer-step windows; "
            "forkrl's trainer trains whole windows (call ppo_train)"
        )

    def _train_window(self, kl_ctl: float) -> None:
        """Run the window's forest (:meth:`TreeRunner.step`): OpenRLHF's loss per micro-batch on the
        leaves, one tree backward, the window's gradient handed to DeepSpeed with micro-batch 0."""
        self.actor.train()
        module = tree_module(self.actor)
        host = self.forkrl.host
        host.device, host.kl_ctl = next(module.parameters()).device, kl_ctl
        for experience, _ in host.window:
            experience.to_device(host.device)
        start = time.perf_counter()
        self.forkrl.step(module, host.window, bool(self.args.actor.gradient_checkpointing_enable))
        host.metrics["tree/step_time"] = time.perf_counter() - start

    def _hand_over(self, surrogate: torch.Tensor) -> None:
        """A micro-batch's backward through DeepSpeed (it scales each by ``1 / accumulated_gradient``,
        as stock's losses): the window's gradient at the first, zero after."""
        self.strategy.backward(surrogate, self.actor, self.actor_optim)

    def _router_weight(self, step: int) -> float:
        """What OpenRLHF's loss multiplies micro-batch ``step``'s router aux loss by."""
        weight = float(self.args.actor.aux_loss_coef)
        if self.args.train.dynamic_batch_enable:
            weight *= float(self.replay_buffer.dynamic_sample_loss_scale[step])
        return weight

    @contextlib.contextmanager
    def _standing_in(self, actor: _LeafActor, strategy: _LossCapture) -> Iterator[None]:
        saved = self.actor, self.strategy
        self.actor, self.strategy = actor, strategy
        try:
            yield
        finally:
            self.actor, self.strategy = saved

    def _finish(self, i: int, step: int) -> dict:
        """Micro-batch ``i``'s tail, as OpenRLHF's ``training_step`` ends: backward (the window's
        gradient at the first micro-batch, zero after), optimizer step, EMA, grad norm, metrics."""
        if i > 0:  # the window's gradient went over with micro-batch 0, inside the step
            self._hand_over(self.forkrl.replica(tree_module(self.actor)).gradient_surrogate(zero=True))
        dynamic = self.args.train.dynamic_batch_enable
        is_step = not dynamic or bool(self.replay_buffer.dynamic_optimizer_step[step])
        if is_step:
            self.strategy.optimizer_step(self.actor_optim, self.actor, self.actor_scheduler, name="actor")
            if self.ema_model:
                self.strategy.moving_average(self.actor, self.ema_model, self.ema_beta, "cuda")
        status = self.forkrl.host.statuses[i]
        metrics, weights = status["metrics"], status["weights"]
        metrics["actor_lr"] = self.actor_scheduler.get_last_lr()[0]
        if is_step:
            metrics["actor_grad_norm"] = self.strategy.get_grad_norm(self.actor)
            weights["actor_grad_norm"] = None
        for key, value in self.forkrl.host.metrics.items():
            metrics[key], weights[key] = value, "sample"
        return status


class OpenRLHFHost(HostDefaults[MicroBatch]):
    """An ``ActorPPOTrainer``'s :class:`~forkrl.core.train.HostAdapter`: OpenRLHF's side of the tree loop.

    Its micro-batches are ``(Experience, loss_batch_info)`` pairs; its loss is OpenRLHF's own
    ``training_step`` with the actor replaced by the tree's leaves (:class:`_LeafActor`) and the
    strategy's backward capturing the loss (:class:`_LossCapture`); its engine is DeepSpeed's.
    Inherited from :class:`~forkrl.core.train.HostDefaults`: :meth:`balancing` (:attr:`balance`).

    Attributes:
        window: the optimizer step's micro-batches as ``ppo_train`` formed them (the rows before
            rebalancing: ``training_step`` finds its micro-batch in it).
        start: the window's first micro-batch's index in ``ppo_train``'s order.
        kl_ctl: the window's KL coefficient.
        device: the actor's device.
        balance: rows move between the ranks (``--forkrl.tree_balance``, decided at setup).
        statuses: per micro-batch of the trained window, OpenRLHF's ``training_step`` status.
        metrics: the window's ``tree/*`` figures.
    """

    def __init__(self, trainer: TreeActorPPOTrainer) -> None:
        self.trainer = trainer
        self.window: list[MicroBatch] = []
        self.start = 0
        self.kl_ctl = 0.0
        self.device: torch.device | None = None
        self.statuses: list[dict | None] = []
        self.metrics: dict[str, float] = {}
        # Under ring attention, this rank's micro-batches of its group's window (module docstring).
        self._mine: list[int] | None = None
        self._owned: list[int] = []

    def parallel(self) -> ParallelContext:
        return ParallelContext(self.device, lockstep=world_size() > 1, context_parallel=self._split)

    @property
    def _split(self):
        """The ring group, when it splits each prompt between its ranks (``long_context_replay``:
        every rank runs the whole window; module docstring); None otherwise."""
        return compat.ring_group() if self.trainer.tree_options.long_context_replay else None

    def rebalance(self, window: Sequence[MicroBatch], cost: CostModel) -> tuple[list[MicroBatch], Rebalanced]:
        """The window's rows over the ranks by tree cost (the same normalisers)."""
        return balance_window(list(window), self.device, cost)

    def inputs(self, window: Sequence[MicroBatch]) -> StepInputs:
        ring = compat.ring_group()
        self._mine = None
        if ring is not None and self._split is None:
            tokens = [int(e.attention_mask.sum()) for e, _ in window]
            self._mine = share_micro_batches(tokens, dist.get_world_size(ring), dist.get_rank(ring))
        self._owned = list(range(len(window))) if self._mine is None else self._mine
        self.statuses = [None] * len(window)
        layouts = [
            _layout(e.sequences, e.action_mask, e.attention_mask)
            for e, _ in map(window.__getitem__, self._owned)
        ]
        return StepInputs(layouts, self._images(window))

    def _images(self, window: Sequence[MicroBatch]) -> list[list[Image]] | None:
        """Per row of this rank's micro-batches (in order), its images; None for a text-only actor.
        A refusal on any rank stops every rank here, before the step's collectives and before any
        gradient."""
        if not self.trainer._is_vlm:
            return None

        def images() -> list[list[Image]]:
            out: list[list[Image]] = []
            for i in self._owned:
                experience = window[i][0]
                rows = int(experience.sequences.shape[0])
                out.extend(
                    row_images(getattr(experience, "mm_train_inputs", None), rows)
                    or [[] for _ in range(rows)]
                )
            return out

        elsewhere = RuntimeError(
            "another data-parallel rank refused this step's images (see its error); nothing was changed"
        )
        return agreed(images, self.device, elsewhere)

    def router_weights(self, window: Sequence[MicroBatch]) -> list[float] | None:
        trainer = self.trainer
        return [trainer._router_weight(self.start + i) for i in self._owned] if trainer.aux_loss else None

    def loss(self, window: Sequence[MicroBatch], router: RouterLoss | None) -> StepLoss:
        trainer, owned = self.trainer, self._owned
        # A ring group's share: each rank backpropagates R times its micro-batches' loss (module docstring).
        scale = 1 if self._mine is None else dist.get_world_size(compat.ring_group())

        def loss_fn(j: int, logps: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
            i = owned[j]
            experience, info = window[i]
            capture = _LossCapture(trainer.strategy)
            aux = router_value(router, j, logps.device)
            with trainer._standing_in(_LeafActor(trainer.actor, logps, entropies, aux), capture):
                self.statuses[i] = ActorPPOTrainer.training_step(
                    trainer, experience, self.kl_ctl, self.start + i, info
                )
            if capture.loss is None:
                raise RuntimeError(
                    "tree step: OpenRLHF's training_step did not hand a loss to strategy.backward"
                )
            return capture.loss * scale if scale != 1 else capture.loss

        return StepLoss(loss_fn, "general", entropy=trainer.args.actor.entropy_coef is not None)

    def context(self) -> AbstractContextManager:
        return compat.ring_attention_off()  # the tree computes whole sequences on each rank

    def log(self, metrics: dict[str, float]) -> None:
        """The window's figures, and under ring attention every micro-batch's status on every rank of
        the group. Before DeepSpeed's backward (the runner hands over after this): under ZeRO-3 its
        reduction may still be in flight when it returns, until the step, and a collective issued
        meanwhile was seen to read a half-reduced buffer (gloo, 2 ranks)."""
        if self._mine is not None:
            self.statuses = _gather_statuses(self.statuses, self._mine, compat.ring_group(), self.device)
        super().log(metrics)

    def hand_over(self, replica: AliasReplica) -> None:
        """Micro-batch 0's backward: the window's gradient, while the parameters are whole (ZeRO-3:
        DeepSpeed's one reduce-scatter of the window); the later micro-batches hand over zero."""
        self.trainer._hand_over(replica.gradient_surrogate())
