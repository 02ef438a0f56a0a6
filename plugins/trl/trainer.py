"""forkrl's GRPOTrainer and RLOOTrainer: stock TRL, with the training phase run over a prefix forest.

Overrides (each delegates to TRL when its flag is off):

- ``__init__``: accepts forkrl's options as keyword arguments (``tree_packing=True``, ...) and
  checks the configuration once.
- ``training_step``: collects the prepared micro-batches of one optimizer step (generation,
  rewards and advantages are TRL's own, unchanged) and at the last one hands them to the trainer's
  :class:`forkrl.core.train.TreeRunner` (``self.forkrl``; TRL's side of it is
  :class:`forkrl.plugins.trl.host.TRLHost`): one forest, TRL's own ``compute_loss`` per
  micro-batch on the tree's log-probs held as leaves, one depth-first backward. The update equals
  stock TRL's.
- ``_get_per_token_logps_and_entropies``: serves those leaves inside the loss (they come as its
  ``model`` argument, a :class:`~forkrl.plugins.trl.host.LeafModel`), and scores old-policy and
  reference log-probs (no-grad calls) with the prefix-shared tree scorer.
- ``_generate_single_turn`` (``speculative_rollout``): handed to the trainer's
  :class:`forkrl.plugins.trl.speculative.TRLSpeculation` (``self.forkrl_spec``): TRL's transformers
  generation through the exact self-speculative sampler, or its vLLM engine drafting with forkrl's
  drafter.

Under DeepSpeed (ZeRO-2/3) the forest trains a replica aliasing the engine's module and the step's
gradient reaches the engine through one backward (:meth:`forkrl.plugins.trl.host.TRLHost.hand_over`).

Inherited unchanged: generation (without ``speculative_rollout``), rewards, advantages, TRL's loss
code, logging, the optimizer step, checkpointing. What is TRL's and so lives here: which of its
losses have a value-independent gradient (:meth:`GRPOTrainer._coefficients_constant`: then one
fused pass), how leaves reach its loss, its refusals, its metrics sink.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from trl import GRPOTrainer as _TRLGRPOTrainer
from trl import RLOOTrainer as _TRLRLOOTrainer

from forkrl.core import UnsupportedModelError
from forkrl.core.balance.rules import IMAGES, BalanceOption
from forkrl.core.train import TreeRunner, is_fsdp2

from ..deepspeed import gathered as deepspeed_gathered
from ..models import missing_model, no_such_model
from . import compat
from .balance import unsafe_reason
from .config import FORKRL_FIELDS, GRPOConfig, RLOOConfig
from .host import IMAGE_KEYS, LeafModel, TRLHost, layout, row_images, row_types
from .speculative import TRLSpeculation

__all__ = ["GRPOTrainer", "RLOOTrainer", "TreeTrainingMixin"]

logger = logging.getLogger(__name__)

#: ``tree_balance`` in TRL's words (core's rule, :mod:`forkrl.core.balance.rules`).
BALANCE = BalanceOption(
    on="tree_balance='on'", auto="tree_balance='auto'", off="tree_balance='off'", update="TRL's update"
)

# Loss types whose gradient at ratio 1 (old log-probs = current, detached) is constant.
_KNOWN_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


class TreeTrainingMixin:
    """Tree training for a TRL online trainer whose loss reads ``_get_per_token_logps_and_entropies``.

    A subclass lists the TRL trainer after this mixin and names it and forkrl's config class in
    ``_trl_base`` and ``_config_class``.
    """

    _trl_base: type = _TRLGRPOTrainer
    _config_class: type = GRPOConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in FORKRL_FIELDS}
        arguments = dict(inspect.signature(self._trl_base.__init__).bind(self, *args, **kwargs).arguments)
        arguments.pop("self")
        if isinstance(arguments.get("model"), str) and missing_model(arguments["model"]):
            raise ValueError(no_such_model("model", arguments["model"]))
        config = arguments.get("args")
        if config is None:
            model = arguments["model"]
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            suffix = self._trl_base.__name__.removesuffix("Trainer")
            config = self._config_class(f"{name.split('/')[-1]}-{suffix}", **options)
        elif options or not isinstance(config, self._config_class):
            config = self._config_class.from_trl(config, **options)
        arguments["args"] = config
        # forkrl's tree training (None: off): the loop around the tree step, with TRL's side (host.py)
        self.forkrl: TreeRunner | None = None
        # forkrl's speculative generation (None: off), composed like the runner (speculative.py)
        self.forkrl_spec = TRLSpeculation(self, config) if config.speculative_rollout else None
        with self.forkrl_spec.engine_arguments(config) if self.forkrl_spec else contextlib.nullcontext():
            super().__init__(**arguments)
        if config.tree_enabled:
            host = TRLHost(self)
            # The tree's LM head as TRL's fused head computes it (add_fused_lm_head): logits in the compute
            # dtype, the gradient products summed in float32; in float32 with cast_lm_head_to_fp32.
            head = "fp32" if getattr(config, "cast_lm_head_to_fp32", False) else "fp32_accumulate"
            self.forkrl = TreeRunner(
                config,
                host,
                temperature=self.temperature,
                # DeepSpeed reduces through hooks on the parameters: the tree trains a replica aliasing
                # them, gathered under ZeRO-3 with DeepSpeed's own context.
                engine=host.engine,
                gather=deepspeed_gathered if host.engine else None,
                head_precision=head,
            )
            self._check_tree_setup()
        if self.forkrl_spec is not None:
            self.forkrl_spec.setup()

    # ------------------------------------------------------------------ setup
    def _unwrapped(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the tree runs: accelerate's wrappers removed, ``torch.compile``'s too (with
        ``torch_compile=True`` the trainer compiles at ``train()``; the tree calls the decoder with
        its own caches and attention, and the compiled module's forward is the same computation)."""
        return self.accelerator.unwrap_model(model, keep_torch_compile=False)

    def _check_tree_setup(self) -> None:
        if self.args.n_gpu > 1:
            raise ValueError(
                "tree_packing does not support torch.nn.DataParallel (n_gpu > 1): launch one process per device "
                "with `accelerate launch` (DDP)"
            )
        model = self._unwrapped(self.model)
        # What the trainer actually built (an accelerate config file can choose an engine without args.fsdp).
        if getattr(self, "is_deepspeed_enabled", False):
            config = compat.deepspeed_config(self)
            if (config.get("fp16") or {}).get("enabled") in (True, "true"):
                raise ValueError(
                    "tree_packing/long_context_replay do not support DeepSpeed's fp16 loss scaling (fp16.enabled in "
                    "your DeepSpeed config): use bf16, or turn tree training off"
                )
            self.forkrl.replica(model)  # built once, here: a model it cannot alias is refused at setup
        if getattr(self, "is_fsdp_enabled", False) and not (
            is_fsdp2(model) or getattr(self.accelerator, "is_fsdp2", False)
        ):
            raise ValueError(
                "tree_packing/long_context_replay support FSDP2 only, and this trainer built FSDP1: set fsdp_version: 2 "
                "in your accelerate config (or fsdp_config={'version': 2, ...}), or turn tree training off"
            )
        self._check_context_parallel()
        self.forkrl.check_model(model, "turn tree_packing off", vision=self._is_vlm)
        base = getattr(model, "get_base_model", lambda: model)()
        if getattr(getattr(base, "config", None), "position_embedding_type", None) == "absolute" or any(
            hasattr(m, name) for m in base.modules() for name in ("wpe", "embed_positions")
        ):
            raise UnsupportedModelError(
                f"{type(base).__name__} uses absolute position embeddings: TRL numbers positions from the padded "
                "batch, so its log-probs depend on the padding and no tree can reproduce them; use a RoPE model, or "
                "turn tree_packing off"
            )
        self.forkrl.host.balance = self._balance_setting()
        if self.args.gradient_checkpointing and self.args.tree_mode == "auto":
            logger.info(
                "gradient_checkpointing=True: tree training runs in replay mode (blocks of %d tokens re-forwarded "
                "on the way back), which is its checkpointing; the model's own checkpointing is off inside tree "
                "passes",
                self.args.replay_block_size,
            )

    def _check_context_parallel(self) -> None:
        """``long_context_cp_size`` > 1: refuse what a group of processes cannot split, at setup."""
        size = self.args.long_context_cp_size
        if size == 1:
            return
        reasons = (
            (getattr(self, "is_deepspeed_enabled", False), "DeepSpeed (tested under DDP only)"),
            (getattr(self, "is_fsdp_enabled", False), "FSDP (tested under DDP only)"),
            (self._is_vlm, "a vision-language model's images"),
            (self.aux_loss_enabled, "a router aux loss (output_router_logits)"),
        )
        why = next((text for applies, text in reasons if applies), None)
        if why is not None:
            raise ValueError(
                f"long_context_cp_size={size} cannot split prompts with {why}: launch with plain DDP (accelerate "
                "launch without a DeepSpeed/FSDP config) and a text model without a router loss, or set "
                "long_context_cp_size=1 (long_context_replay still runs each prompt on one device)"
            )

    def _balance_setting(self) -> bool:
        """Whether each step's rows are rebalanced over the data-parallel ranks (``tree_balance``),
        decided once, the same on every rank (the balancer is a collective), by core's rule."""
        choice, ranks = self.args.tree_balance, self.accelerator.num_processes
        fixed = IMAGES if self._is_vlm else None
        if self.args.long_context_cp_size > 1:  # the config refuses 'on' with it first
            fixed = "which a context-parallel group does not do: it trains its rows where they are"
        loss = unsafe_reason(self) if ranks > 1 and fixed is None else None
        refused = BALANCE.refusal(choice, ranks, fixed=fixed, loss=loss, counted="launched as one process")
        if refused is not None:
            raise ValueError(refused)
        moves = BALANCE.balances(choice, ranks, fixed=fixed, loss=loss)
        if not moves and choice == "auto" and ranks > 1:
            logger.info("tree_balance: rows stay where TRL put them (%s)", fixed or loss)
        return moves

    # ------------------------------------------------------------------ TRL hooks
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **kwargs,
    ):
        """TRL's method; inside a tree step (``model`` is a :class:`LeafModel`) it returns the tree's leaves,
        and no-grad calls are tree-scored."""
        if isinstance(model, LeafModel):
            logps, entropies, aux = model.logps, model.entropies, model.aux
            if tuple(logps.shape) != (input_ids.shape[0], logits_to_keep):
                raise RuntimeError(
                    f"tree step: the loss asked for log-probs of shape {(input_ids.shape[0], logits_to_keep)} but the "
                    f"micro-batch has {tuple(logps.shape)}"
                )
            # The router loss's value (its gradient is the tree's: a constant here).
            return logps, (entropies if compute_entropy else None), (aux if compute_aux_loss else None)
        other = [k for k, v in kwargs.items() if v is not None and k not in IMAGE_KEYS]
        if self.forkrl is not None and not torch.is_grad_enabled() and not compute_aux_loss and not other:
            with self.accelerator.autocast():
                lp, ent = self.forkrl.tree().score(
                    self._unwrapped(model),
                    layout(input_ids, attention_mask, logits_to_keep),
                    entropy=compute_entropy,
                    images=row_images(kwargs, input_ids.shape[0]),
                    token_types=row_types(kwargs, attention_mask),
                    parallel=self.forkrl.host.parallel(),  # long_context_cp_size: scored by the group
                )
            return lp.to(input_ids.device), (ent.to(input_ids.device) if ent is not None else None), None
        return super()._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss,
            **kwargs,
        )

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's step when tree training is off; otherwise defers the micro-batch to the window's end."""
        if self.forkrl is None:
            return super().training_step(model, inputs, num_items_in_batch)
        time_before = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        window = self.forkrl.host.window
        window.append((inputs, num_items_in_batch))
        compat.advance_micro_step(self)
        if self.accelerator.sync_gradients or len(window) >= self.current_gradient_accumulation_steps:
            loss = self._tree_update(model)
        else:
            # The window's losses are returned, summed, by its last micro-batch (the logged total is the same).
            loss = torch.zeros((), device=self.args.device)
        compat.add_step_time(self, time.perf_counter() - time_before)
        return loss

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
        """TRL's generation, or with ``speculative_rollout`` the trainer's :class:`TRLSpeculation`'s."""
        stock = super()._generate_single_turn
        if self.forkrl_spec is None:
            return stock(prompt_ids, images, multimodal_fields, *args, **kwargs)
        return self.forkrl_spec.generate(stock, prompt_ids, images, multimodal_fields, *args, **kwargs)

    # ------------------------------------------------------------------ the window's update
    def _tree_update(self, model) -> torch.Tensor:
        """The window's micro-batches as one tree step (:meth:`TreeRunner.step`); returns their summed loss."""
        host = self.forkrl.host
        window, host.window, host.model = host.window, [], model
        run = self.forkrl.step(self._unwrapped(model), window, self.args.gradient_checkpointing)
        host.step_engine()
        return run.loss

    def _scale_like_training_step(self, loss: torch.Tensor, num_items) -> torch.Tensor:
        # transformers' Trainer.training_step divides by the accumulation steps unless the loss says
        # it is already scaled (TRL's GRPO sets loss_is_scaled_for_ga = True).
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items is not None
            ) or self.compute_loss_func is not None
        return loss if scaled else loss / self.current_gradient_accumulation_steps

    def _router_weight(self, num_items) -> float:
        """What the backward sees multiplying a micro-batch's router aux loss: the coefficient, over
        the accumulation steps where TRL's loss divides it (GRPO), times the training step's scaling."""
        weight = self.router_aux_loss_coef
        if self._aux_over_accumulation:
            weight /= self.current_gradient_accumulation_steps
        return float(self._scale_like_training_step(torch.tensor(weight, dtype=torch.float64), num_items))

    def _coefficients_constant(self, window) -> bool:
        """Whether the host loss's gradient w.r.t. log-probs/entropies is the same at any values
        (then one fused pass, after a probe). The mixin assumes not; hosts that know better override."""
        return False

    def _own_loss(self) -> bool:
        """The loss is the TRL base class's own code (not a user subclass's override)."""
        cls, base = type(self), self._trl_base
        return cls._compute_loss is base._compute_loss and cls.compute_loss is base.compute_loss

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Evaluate TRL's loss without side effects: metrics go to a scratch dict and any attribute
        the loss reassigns (adaptive-entropy state) is restored."""
        saved = dict(vars(self))
        try:
            with compat.scratch_metrics(self):
                yield
        finally:
            for key, value in saved.items():
                if getattr(self, key, None) is not value:
                    setattr(self, key, value)


class GRPOTrainer(TreeTrainingMixin, _TRLGRPOTrainer):
    """TRL's ``GRPOTrainer`` with forkrl's tree training and speculative rollouts.

    Used exactly like ``trl.GRPOTrainer``; pass ``args=forkrl.plugins.trl.GRPOConfig(...,
    tree_packing=True)``, or forkrl's options as keyword arguments
    (``GRPOTrainer(model, reward_funcs, args=trl_args, tree_packing=True)``), which are merged into a
    copy of ``args``.
    """

    _trl_base = _TRLGRPOTrainer
    _config_class = GRPOConfig
    _aux_over_accumulation = True  # GRPO: loss + coef * aux / accumulation steps

    def _coefficients_constant(self, window) -> bool:
        """True when the importance ratio is ``exp(logp - logp.detach()) == 1`` (no old log-probs)
        and nothing else reads the values: no KL term, no entropy-quantile or off-policy mask, TRL's
        own loss code (not a subclass override), and no clipping bound at exactly 1."""
        if not self._own_loss():
            return False
        if any("old_per_token_logps" in inputs for inputs, _ in window):
            return False
        if self.beta != 0.0 or self.top_entropy_quantile < 1.0 or self.off_policy_mask_threshold is not None:
            return False
        if self.loss_type not in _KNOWN_LOSSES or self.epsilon_low <= 0 or self.epsilon_high <= 0:
            return False
        delta = self.args.delta
        return delta is None or delta > 1.0


class RLOOTrainer(TreeTrainingMixin, _TRLRLOOTrainer):
    """TRL's ``RLOOTrainer`` with forkrl's tree training (``RLOOConfig(..., tree_packing=True)``).

    RLOO's loss is sequence-level (a clipped ratio of summed log-probs against ``old_logps``, which
    TRL always computes; forkrl scores them with the tree), so every step takes the scoring pass
    before the tree backward.
    """

    _trl_base = _TRLRLOOTrainer
    _config_class = RLOOConfig
    _aux_over_accumulation = False  # RLOO: loss + coef * aux (the Trainer divides the sum)
