"""forkrl's veRL engine: the FSDP2 engine with LM head, its batches trained and scored as prefix trees.

Overrides one method, ``forward_backward_batch`` (training and ``forward_only`` scoring). Everything
else is veRL's own, inherited unchanged: model building and FSDP2 sharding, the optimizer step and
gradient clipping, checkpointing, weight sync to the rollout, and the loss (``ppo_loss`` with every
registered policy loss, ``agg_loss`` mode, KL and entropy term, rollout importance weights).

One call trains one mini-batch of this rank (an optimizer step): veRL's own micro-batch partition
(fixed size or dynamic batch size) is kept, because its loss may normalise by a micro-batch's
width; all micro-batches are one forest for the engine's :class:`forkrl.core.train.TreeRunner`
(``self.forkrl``; veRL's side of it is :class:`VeRLHost`); veRL's loss runs
per micro-batch on the tree's log-probs, placed as veRL places its own (nested over whole rows,
rolled by one); one tree backward; the gradients are reduce-scattered into FSDP2's shards once.
Old and reference log-probs (``forward_only``) are scored as one forest too.

Vision-language models (the families of :mod:`forkrl.core.executor.vision`): each row's
``multi_modal_inputs`` (veRL's agent loop: the processor's ``pixel_values`` and ``image_grid_thw``
per row, ``{}`` for a text row) become the row's images, each unique image through the vision tower
once per pass; veRL's class-wide forwards for these models are swapped for transformers' own
inside the tree passes (:func:`forkrl.plugins.verl.compat.transformers_forwards`). veRL's ``[4, T]``
position ids (text positions, then the three M-RoPE rows) are not read: the core computes the
M-RoPE rows with the model's own ``get_rope_index`` from the same ids and grids (veRL binds that same
function to its processor; ``tests/verl/test_verl_vlm.py`` checks they agree), and finds
placeholders by ``image_token_id``, as veRL's patched forward and its position ids do (veRL carries
no token types to the actor). Refused: video, other multi-modal fields, and with a vision-language
model Ulysses sequence parallelism, ``tree_mode: packed`` and ``tree_balance: on`` (``auto`` leaves
its rows where veRL put them). Checked against stock veRL: Qwen2-VL and Qwen2.5-VL.

Refusals: what the configuration decides is refused on the driver (:mod:`forkrl.plugins.verl.config`)
and again here as a safety net; what a batch decides (images, routed experts, teacher log-probs,
per-sample temperatures) is refused here before any pass, agreed over every rank first, so that a
rank whose rows are refused does not leave the others waiting in the step's first collective.
``tree_mode: auto`` reads veRL's ``model.enable_gradient_checkpointing`` (replay when it is on).

With several data-parallel ranks (``forkrl.tree_balance: auto``, the default), each mini-batch's
rows are first moved between the ranks by predicted tree cost (:mod:`forkrl.plugins.verl.balance`),
priced by a cost model fitted to every rank's measured steps.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch
from verl.utils.device import get_device_id, get_device_name
from verl.utils.metric import AggregationType, Metric
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from forkrl.core import RowLayout, TreeOptions, UnsupportedModelError
from forkrl.core.balance import CostModel, Rebalanced
from forkrl.core.balance.rules import IMAGES
from forkrl.core.executor import RouterLoss
from forkrl.core.executor.vision import Image, processor_images
from forkrl.core.train import (
    HostDefaults,
    ParallelContext,
    StepInputs,
    StepLoss,
    TreeRunner,
    agreed,
    share_micro_batches,
)

from . import compat
from .balance import OPTION, balance_mini_batch
from .ulysses import gather_outputs

__all__ = ["BACKEND", "TreeFSDPEngineWithLMHead", "VeRLHost"]

logger = logging.getLogger(__name__)

#: The engine backend (``actor.strategy`` stays ``fsdp2``; forkrl's config names this backend).
BACKEND = "fsdp2_tree"

#: How a refusal names the way out (replacing the core's host-neutral phrase).
WAY_OUT = "set forkrl.tree_packing=false for this model (veRL's own engine)"


# Registered where the class is defined, as veRL registers its own engines: once per process,
# whichever of veRL's plugin loading (autoload) and forkrl's config imports this module first.
@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "npu"])
class TreeFSDPEngineWithLMHead(FSDPEngineWithLMHead):
    """veRL's ``FSDPEngineWithLMHead`` with ``forward_backward_batch`` run over a prefix forest.

    The tree options come from the engine config's ``forkrl`` attribute (set by
    :class:`forkrl.plugins.verl.config.ForkrlFSDPActorConfig`); the backend name is mapped back to
    ``fsdp2`` before veRL builds anything, so every other part of veRL sees its own FSDP2 engine.
    """

    def __init__(
        self, model_config, engine_config, optimizer_config, checkpoint_config, *args, **kwargs
    ) -> None:
        options = getattr(engine_config, "forkrl", None)
        self._tree_options: TreeOptions = (
            options if isinstance(options, TreeOptions) else TreeOptions(tree_packing=True)
        )
        # Before the model is built (the driver refuses it first, forkrl.plugins.verl.config).
        if getattr(model_config, "lora_rank", 0) > 0:
            raise ValueError(
                f"forkrl's tree engine does not train LoRA policies (actor_rollout_ref.model.lora_rank="
                f"{model_config.lora_rank}): set lora_rank=0, or forkrl.tree_packing=false for veRL's own engine"
            )
        object.__setattr__(engine_config, "strategy", "fsdp2")
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config, *args, **kwargs)
        # forkrl's tree loop (one TreeStep per sampling temperature), with veRL's side (VeRLHost).
        self.forkrl = TreeRunner(self._tree_options, VeRLHost(self))
        logger.info("forkrl: veRL engine %s active (%s)", BACKEND, self._tree_options)

    def initialize(self) -> None:
        """veRL's method (the model and optimizer built), then the tree's model check, so a model no
        tree can run, or one the Ulysses group cannot split under ``long_context_replay``, is refused
        when the worker starts, before the first rollout."""
        super().initialize()
        if self._tree_options.tree_enabled:  # images are checked per batch (_refuse: the FSDP-wrapped class)
            self.forkrl.check_model(self.module, WAY_OUT)

    # ------------------------------------------------------------------ the override
    def forward_backward_batch(self, data, loss_function, forward_only: bool = False):
        """veRL's method: one mini-batch's forward and backward (or forward only) over one forest."""
        if not self._tree_options.tree_enabled:
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        self._refuse_on_every_rank(data)
        host = self.forkrl.host
        host.begin(data, loss_function)
        (temperature,) = _temperatures([data])  # one: checked by _refuse on every rank
        try:
            if forward_only:
                outputs = self._score(host, data, temperature)
            else:
                run = self.forkrl.step(
                    self.module,
                    [data],
                    # tree_mode auto replays under veRL's checkpointing (on in its default config)
                    bool(self.model_config.enable_gradient_checkpointing),
                    temperature,
                )
                outputs = host.outputs(run.result, data)
        except UnsupportedModelError as err:
            raise err.for_host(WAY_OUT) from err
        micro_batches, mine = host.micro_batches, host.mine
        if mine is not None:  # the Ulysses group's micro-batches, on every rank of it
            outputs = gather_outputs(
                outputs,
                mine,
                len(micro_batches),
                self.ulysses_parallel_group,
                lambda i, lp, ent: _model_output(
                    micro_batches[i], lp.to(get_device_id()), None if ent is None else ent.to(get_device_id())
                ),
            )
        return compat.postprocess(outputs, host.indices, data)

    def _score(self, host: VeRLHost, data, temperature: float) -> list[dict]:
        """``forward_only``: the micro-batches' log-probs (and entropies) as one forest, and veRL's
        loss function on them where it passes one."""
        inputs = host.split(data)
        with host.context():
            scored = self.forkrl.tree(temperature).score_window(
                self.module,
                inputs.layouts,
                entropy=host.entropy,
                images=inputs.images,
                parallel=host.parallel(),
            )
            outputs = []
            for mb, (lp, ent) in zip(host.own, scored, strict=True):
                model_output = _model_output(mb, lp, ent)
                loss, metrics = torch.tensor(1.0), {}
                if host.loss_function is not None:
                    loss, metrics = host.loss_function(
                        model_output=model_output, data=mb, dp_group=self.get_data_parallel_group()
                    )
                outputs.append(
                    {"model_output": model_output, "loss": float(loss.detach()), "metrics": metrics}
                )
        return outputs

    @property
    def _context_parallel(self):
        """The Ulysses group, when it splits each prompt between its ranks (``long_context_replay``:
        :class:`forkrl.core.executor.ContextParallelExecutor`); None otherwise."""
        if self.ulysses_sequence_parallel_size > 1 and self._tree_options.long_context_replay:
            return self.ulysses_parallel_group
        return None

    def _share(self, micro_batches) -> list[int] | None:
        """The micro-batches this rank runs of its Ulysses group's mini-batch (None: all of them: no
        Ulysses group, or one that splits each prompt instead)."""
        size = self.ulysses_sequence_parallel_size
        if size <= 1 or self._context_parallel is not None:
            return None
        tokens = [int(mb["input_ids"].offsets()[-1]) for mb in micro_batches]
        return share_micro_batches(tokens, size, self.ulysses_device_mesh["sp"].get_local_rank())

    # ------------------------------------------------------------------ setup and refusals
    def _balancing(self, data) -> bool:
        """Whether this mini-batch's rows are rebalanced over the dp ranks (the same answer on every
        rank: the config, the dp size and the driver's flags are shared)."""
        choice, ranks = self._tree_options.tree_balance, self.get_data_parallel_size()
        if choice == "off" or ranks < 2 or self.ulysses_sequence_parallel_size > 1:
            return False  # a Ulysses group shares its micro-batches instead (module ulysses)
        # Decided by the model, the same on every rank (the config refuses "on" with the others first).
        fixed = IMAGES if _is_vlm(self.module) else None
        if fixed is not None and choice == "on":
            raise ValueError(OPTION.refusal(choice, fixed=fixed))
        loss = getattr(self.engine_config, "forkrl_balance_unsafe", None)
        if not OPTION.balances(choice, ranks, fixed=fixed, loss=loss):
            return False
        return not compat.non_tensor(data, "return_model_output", False)  # per-row outputs stay on their rank

    def _refuse_on_every_rank(self, data) -> None:
        """:meth:`_refuse`, agreed over the world group before the first collective of the step:
        a refusal on one rank (its rows hold video, say) is raised on every rank, and nothing has
        changed on any (no rank is left waiting in an all-reduce the refusing rank never reaches)."""
        elsewhere = ValueError(
            "another rank refused this batch before the step (see that rank's error: forkrl's tree engine cannot "
            "take its rows); nothing was computed or changed on any rank"
        )
        agreed(lambda: self._refuse(data), get_device_id(), elsewhere)

    def _refuse(self, data) -> None:
        """Raise ValueError for what forkrl's tree engine does not run, before any pass: the
        configuration's part (refused on the driver first, :mod:`forkrl.plugins.verl.config`) and
        what only the batch decides (images, routed experts, teacher log-probs, temperatures)."""
        temps = _temperatures([data])
        if len(temps) != 1:
            raise ValueError(
                f"forkrl's tree engine scores one temperature per mini-batch; this one has {sorted(temps)} per sample: "
                "use one rollout temperature, or set forkrl.tree_packing=false"
            )
        flags = {
            "use_fused_kernels": "the fused LM-head kernels (use_fused_kernels=false)",
            "distillation_use_topk": "top-k distillation",
            "distillation_only": "distillation",
            "calculate_sum_pi_squared": "the sum of squared probabilities (calculate_sum_pi_squared)",
        }
        for key, what in flags.items():
            if compat.non_tensor(data, key, False):
                raise ValueError(
                    f"forkrl's tree engine does not support {what}: turn it off or set forkrl.tree_packing=false"
                )
        problems = self._engine_settings()
        # By content: veRL's v1 agent loop writes multi_modal_inputs ({} per text row) for every run.
        if any(compat.carries(data, k) for k in ("routed_experts", "teacher_logprobs")):
            problems.append("routed experts or teacher log-probs")
        if _is_vlm(self.module):
            self._refuse_vlm_setup()
        if compat.carries(data, "multi_modal_inputs"):
            self._refuse_images(data, problems)
        if problems:
            raise ValueError(
                f"forkrl's tree engine cannot run exactly with {', '.join(problems)}: turn it off, or set "
                "forkrl.tree_packing=false to use veRL's own engine"
            )

    def _engine_settings(self) -> list[str]:
        """The engine's own settings the tree does not take (the driver refuses them first)."""
        problems = []
        if getattr(self, "scaler", None) is not None:
            problems.append("fp16 loss scaling (use bf16)")
        if getattr(self, "pad_to_length", False):
            problems.append("pad_to_length")
        if self.is_param_offload_enabled:
            problems.append("parameter offload")
        return problems

    def _refuse_vlm_setup(self) -> None:
        """A vision-language model's setups the tree does not take, decided by the model and the
        config (the same on every rank, whatever a rank's rows hold)."""
        if self._tree_options.tree_mode == "packed" and not self._tree_options.long_context_replay:
            raise UnsupportedModelError(
                "images on a tree run in keep or replay mode (the packed tree mask takes token ids): set "
                f"forkrl.tree_mode=auto, keep or replay, or {WAY_OUT}"
            )
        if self.ulysses_sequence_parallel_size > 1:
            raise UnsupportedModelError(
                "forkrl's tree engine does not run vision-language models under Ulysses sequence parallelism "
                f"(ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size}; veRL slices their inputs "
                f"after the embedding): set it to 1, or {WAY_OUT}"
            )

    def _refuse_images(self, data, problems: list[str]) -> None:
        """Images the tree cannot take, raised before any pass (no parameter or gradient changed).
        A vision-language family the core does not serve is refused by the core as it prepares the
        images, before the first forward (:func:`forkrl.core.executor.vision.check_model`)."""
        if not _is_vlm(self.module):  # images for a text model
            name = type(_unwrapped(self.module)).__name__.removeprefix("FSDP")
            problems.append(f"multi-modal inputs for {name}, which is not a vision-language model")
            return
        for i, row in enumerate(compat.multi_modal_rows(data) or []):
            _row_images(row, i)  # raises for video and for fields it does not know


def _temperatures(batches) -> set[float]:
    """The sampling temperatures of veRL batches (a scalar field, or one per row)."""
    return {float(t) for b in batches for t in torch.as_tensor(b["temperature"]).reshape(-1).tolist()}


def _unwrapped(module):
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def _is_vlm(module) -> bool:
    return getattr(_unwrapped(module).config, "vision_config", None) is not None


def _row_images(row: dict, index: int) -> list[Image]:
    """One row's images from its ``multi_modal_inputs`` (:func:`~forkrl.core.executor.vision.processor_images`;
    ``images_seqlens`` is veRL's own per-image token count, read by none of the supported models' forwards)."""
    return processor_images(row, f"row {index}", "multi_modal_inputs", WAY_OUT, ignored=("images_seqlens",))


def _window_images(micro_batches) -> list[list[Image]] | None:
    """Per row of the micro-batches (in order), its images; None when no row has any."""
    out = []
    for mb in micro_batches:
        rows = compat.multi_modal_rows(mb)
        out.extend(
            [[] for _ in range(len(mb))] if rows is None else [_row_images(r, i) for i, r in enumerate(rows)]
        )
    return out if any(out) else None


def _layout(micro_batch) -> RowLayout:
    """A veRL micro-batch's rows (nested input_ids) with veRL's rolled, nested per-token layout."""
    input_ids = micro_batch["input_ids"]
    offsets = input_ids.offsets()
    prompt_lens = compat.prompt_lengths(micro_batch)
    return RowLayout.packed(input_ids.values(), offsets, prompt_lens, align="next")


def _model_output(micro_batch, logps: torch.Tensor, entropies: torch.Tensor | None) -> dict:
    """The tree's values as veRL's engine returns its own: nested over whole rows."""
    offsets = micro_batch["input_ids"].offsets().to(logps.device)
    out = {"log_probs": torch.nested.nested_tensor_from_jagged(logps, offsets)}
    if entropies is not None:
        out["entropy"] = torch.nested.nested_tensor_from_jagged(entropies, offsets)
    return out


class VeRLHost(HostDefaults):
    """The engine's :class:`~forkrl.core.train.HostAdapter`: veRL's side of the tree loop.

    A window is one mini-batch (``[data]``, one ``DataProto``): rebalanced as a whole
    (:func:`~forkrl.plugins.verl.balance.balance_mini_batch`), then split into veRL's own
    micro-batches (fixed size or dynamic; the same count after rebalancing) and, under Ulysses, this
    rank's share of them (module :mod:`forkrl.plugins.verl.ulysses`). Its loss is veRL's
    ``loss_function`` per micro-batch on the tree's values placed as veRL places its own.
    Inherited from :class:`~forkrl.core.train.HostDefaults`: no router loss (veRL's loss adds
    none), no hand-over (veRL's FSDP2 engine reduces on its own), :meth:`log` keeping the figures.

    Attributes (of the current call, set by :meth:`begin` and :meth:`split`):
        micro_batches: the mini-batch's micro-batches, on the device; ``indices`` veRL's order of them.
        mine: under Ulysses, the indices this rank runs (None: all); ``own`` those micro-batches,
            ``layouts`` theirs.
        entropy: veRL asks for entropies (``calculate_entropy``).
    """

    def __init__(self, engine: TreeFSDPEngineWithLMHead) -> None:
        self.engine = engine
        self.begin(None, None)

    def begin(self, data, loss_function) -> None:
        """A new ``forward_backward_batch`` call on ``data``."""
        self.loss_function = loss_function
        # Before rebalancing: the micro-batch count must stay veRL's own (its loss may normalise by it).
        self.count = None if data is None else compat.fixed_micro_batch_count(data)
        self.entropy = data is not None and bool(compat.non_tensor(data, "calculate_entropy", False))
        self.balanced = False
        self.micro_batches: list = []
        self.indices = None
        self.mine: list[int] | None = None
        self.own: list = []
        self.layouts: list[RowLayout] = []
        self.last: dict[int, tuple[torch.Tensor, dict]] = {}
        self.metrics: dict[str, float] = {}

    def split(self, data) -> StepInputs:
        """``data``'s micro-batches as veRL splits them, this rank's share, their layouts and images."""
        engine = self.engine
        compat.global_batch_info(engine, data)
        if self.balanced:  # the row count may have changed: the micro-batch count must not
            micro_batches, self.indices = compat.micro_batches_of_any_size(engine, data, self.count)
        else:
            micro_batches, self.indices = compat.micro_batches(engine, data)
        self.micro_batches = [mb.to(get_device_id()) for mb in micro_batches]  # as stock forward_step does
        self.mine = engine._share(self.micro_batches)  # under Ulysses: this rank's share (module ulysses)
        self.own = self.micro_batches if self.mine is None else [self.micro_batches[i] for i in self.mine]
        self.layouts = [_layout(mb) for mb in self.own]
        return StepInputs(self.layouts, _window_images(self.own))  # images per row (None: no row has any)

    # ------------------------------------------------------------------ HostAdapter
    def parallel(self) -> ParallelContext:
        engine = self.engine
        return ParallelContext(
            balance_group=engine.get_data_parallel_group(),
            # veRL averages each rank's metrics; a Ulysses group's step is one: tokens summed, times maxed
            local_metrics=self.mine is None,
            metrics_group=None if self.mine is None else engine.ulysses_parallel_group,
            # long_context_replay: the group splits each prompt; every rank ends with the whole
            # gradient, and FSDP's average over dp x sp ranks is then stock's (module ulysses)
            context_parallel=engine._context_parallel,
        )

    def balancing(self, window: Sequence) -> bool:
        return self.engine._balancing(window[0])

    def rebalance(self, window: Sequence, cost: CostModel) -> tuple[list, Rebalanced]:
        """The mini-batch's rows over the dp ranks by tree cost."""
        group = self.engine.get_data_parallel_group()
        data, balanced = balance_mini_batch(window[0], cost, group=group, min_rows=self.count or 1)
        self.balanced = True
        return [data], balanced

    def inputs(self, window: Sequence) -> StepInputs:
        return self.split(window[0])

    def loss(self, window: Sequence, router: RouterLoss | None) -> StepLoss:
        engine, own = self.engine, self.own
        # A Ulysses group's share: each backpropagates sp times its loss (module ulysses).
        scale = 1 if self.mine is None else engine.ulysses_sequence_parallel_size

        def loss_fn(i: int, logps: torch.Tensor, ents: torch.Tensor | None) -> torch.Tensor:
            model_output = _model_output(own[i], logps, ents if self.entropy else None)
            loss, metrics = self.loss_function(
                model_output=model_output, data=own[i], dp_group=engine.get_data_parallel_group()
            )
            self.last[i] = (loss, metrics)  # the bridge evaluates the real values last
            return loss * scale if scale != 1 else loss

        return StepLoss(loss_fn, "general", entropy=self.entropy)

    def context(self) -> AbstractContextManager:
        """veRL's mixed precision as its own forward runs it, Ulysses and veRL's model patches off."""
        engine = self.engine
        stack = contextlib.ExitStack()
        dtype = compat.autocast_dtype(engine)
        if dtype != torch.float32:
            stack.enter_context(torch.autocast(device_type=get_device_name(), dtype=dtype))
        stack.enter_context(compat.ulysses_off(engine))
        stack.enter_context(compat.transformers_forwards(engine.module))
        return stack

    # ------------------------------------------------------------------ after the step
    def outputs(self, result, data) -> list[dict]:
        """veRL's per-micro-batch outputs of a trained step: loss, metrics (the step's ``tree/*``
        figures once per step, on its first micro-batch) and, where asked, the model output."""
        keep_output = bool(compat.non_tensor(data, "return_model_output", False))
        per_row = iter(result.objective.logprobs)
        outputs = []
        for i, mb in enumerate(self.own):
            loss, metrics = self.last[i]
            out = {"loss": float(loss.detach()), "metrics": dict(metrics)}
            rows = [next(per_row) for _ in self.layouts[i].sequences]
            if keep_output:
                out["model_output"] = _model_output(mb, self.layouts[i].to_host(torch.cat(rows)), None)
            outputs.append(out)
        if self.mine is None or self.mine[0] == 0:  # once per step: on the first micro-batch
            for key, value in self.metrics.items():
                outputs[0]["metrics"][key] = Metric(value=value, aggregation=AggregationType.MEAN)
        return outputs
