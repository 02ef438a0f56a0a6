"""forkrl's GRPOTrainer and RLOOTrainer: stock TRL, with the training phase run over a prefix forest.

Overrides (each delegates to TRL when tree training is off):

- ``__init__``: accepts forkrl's options as keyword arguments (``tree_packing=True``, ...) and
  checks the configuration once.
- ``training_step``: collects the prepared micro-batches of one optimizer step (generation,
  rewards and advantages are TRL's own, unchanged), and at the last one trains them all as one
  forest: TRL's own ``compute_loss`` is evaluated per micro-batch on the tree's log-probs held as
  leaf tensors, and the gradient with respect to those log-probs drives one depth-first backward
  pass (:mod:`forkrl.core.objective`'s bridge). The update equals stock TRL's.
- ``_get_per_token_logps_and_entropies``: serves those leaves inside the loss, and scores
  old-policy and reference log-probs (no-grad calls) with the prefix-shared tree scorer.

When the loss's gradient with respect to the log-probs cannot depend on their values (no old or
reference log-probs, no entropy-quantile or off-policy masks: TRL's default on-policy setting), the
coefficients are taken from TRL's loss once, checked at a second point, and the tree runs a single
fused pass; otherwise a no-grad scoring pass comes first.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from trl import GRPOTrainer as _TRLGRPOTrainer
from trl import RLOOTrainer as _TRLRLOOTrainer

from forkrl.core import PrefixForest, TreeExecutor, UnsupportedModelError

from .config import FORKRL_FIELDS, GRPOConfig, RLOOConfig
from .layout import RowLayout, from_padded, gather_rows, scatter_rows

__all__ = ["GRPOTrainer", "MODE_CODES", "RLOOTrainer", "TreeTrainingMixin"]

logger = logging.getLogger(__name__)

# `tree/mode` is logged as a number (TRL averages metrics): keep 0, replay 1, packed 2.
MODE_CODES = {"keep": 0, "replay": 1, "packed": 2}
_DEFAULT_BLOCK = 2048
# Inputs of vision-language batches: the tree path is text-only.
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
    "num_images",
    "num_tiles",
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
        bound = inspect.signature(self._trl_base.__init__).bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        config = arguments.get("args")
        if config is None:
            model = arguments["model"]
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            suffix = self._trl_base.__name__.removesuffix("Trainer")
            config = self._config_class(f"{name.split('/')[-1]}-{suffix}", **options)
        elif options or not isinstance(config, self._config_class):
            config = self._config_class.from_trl(config, **options)
        arguments["args"] = config
        self._tree_window: list[tuple[dict[str, Any], Any]] = []
        self._tree_leaves: tuple[torch.Tensor, torch.Tensor] | None = None
        self._tree_executors: dict[tuple[int, str], TreeExecutor] = {}
        self._tree_score_time = 0.0
        self._tree_fused_ok = True
        self._spec_sampler = None
        self._spec_step = -1
        super().__init__(**arguments)
        if config.tree_enabled:
            self._check_tree_setup()
        if config.speculative_rollout:
            self._check_speculative_setup()

    # ------------------------------------------------------------------ setup
    def _check_tree_setup(self) -> None:
        args = self.args
        if self.aux_loss_enabled:
            raise ValueError(
                "tree_packing cannot add the MoE router load-balancing loss (router_aux_loss_coef != 0 with a model "
                "that outputs router logits): set router_aux_loss_coef=0.0, or turn tree_packing off"
            )
        if self._is_vlm:
            raise ValueError(
                "tree_packing supports text-only causal LMs; this is a vision-language model: turn tree_packing off"
            )
        if args.n_gpu > 1:
            raise ValueError(
                "tree_packing does not support torch.nn.DataParallel (n_gpu > 1): launch one process per device "
                "with `accelerate launch` (DDP)"
            )
        model = self.accelerator.unwrap_model(self.model)
        try:
            self._executor(model, "keep")
        except UnsupportedModelError as err:
            raise UnsupportedModelError(f"{err}; or turn tree_packing off") from err
        base = getattr(model, "get_base_model", lambda: model)()
        config = getattr(base, "config", None)
        if getattr(config, "position_embedding_type", None) == "absolute" or any(
            hasattr(m, name) for m in base.modules() for name in ("wpe", "embed_positions")
        ):
            raise UnsupportedModelError(
                f"{type(base).__name__} uses absolute position embeddings: TRL numbers positions from the padded "
                "batch, so its log-probs depend on the padding and no tree can reproduce them; use a RoPE model, or "
                "turn tree_packing off"
            )
        if args.gradient_checkpointing and args.tree_mode == "auto":
            logger.info(
                "gradient_checkpointing=True: tree training runs in replay mode (blocks of %d tokens re-forwarded "
                "on the way back), which is its checkpointing; the model's own checkpointing is off inside tree "
                "passes",
                args.tree_block_size or _DEFAULT_BLOCK,
            )

    def _check_speculative_setup(self) -> None:
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "peft_config"):
            raise ValueError(
                "speculative_rollout does not support PEFT adapters yet (the drafter quantizes the base weights, not "
                "base + adapter): merge the adapter or set speculative_rollout=False"
            )
        if self._is_vlm:
            raise ValueError("speculative_rollout supports text-only models: set speculative_rollout=False")

    def _speculative_sampler(self, model: torch.nn.Module, prompt_lengths: list[int]):
        """The sampler, its drafter re-derived from the current weights once per optimizer step."""
        from forkrl.core.speculative import Drafter, SpeculationPolicy, SpeculativeSampler

        args = self.args
        if self._spec_sampler is None:
            dtype = next(model.parameters()).dtype
            drafter = Drafter.from_policy(
                model,
                bits=args.speculative_bits,
                group_size=args.speculative_group_size if args.speculative_bits == 4 else None,
                compute_dtype=torch.bfloat16 if dtype == torch.float32 else dtype,
            )
            if args.speculative_policy == "always":
                policy = SpeculationPolicy.fixed(args.speculative_draft_len)
            else:
                context = (
                    int(sorted(prompt_lengths)[len(prompt_lengths) // 2]) + self.max_completion_length // 2
                )
                sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= max(1, len(prompt_lengths))]
                policy = SpeculationPolicy.calibrate(
                    model,
                    drafter,
                    batch_sizes=sizes,
                    context_len=context,
                    temperature=self.temperature,
                    top_k=self.top_k or None,
                    top_p=self.top_p,
                    margin=args.speculative_margin,
                )
            self._spec_sampler = SpeculativeSampler(model, drafter, policy)
            self._spec_step = self.state.global_step
        elif self._spec_step != self.state.global_step:
            self._spec_sampler.drafter.refresh(model)
            self._spec_step = self.state.global_step
        return self._spec_sampler

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
        """TRL's generation, or with ``speculative_rollout`` the exact self-speculative sampler."""
        if not getattr(self.args, "speculative_rollout", False) or images is not None or multimodal_fields:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        from trl.models import unwrap_model_for_generation

        device = self.accelerator.device
        pad_id = self._tokenizer.pad_token_id
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for b, ids in enumerate(prompt_ids):
            input_ids[b, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[b, width - len(ids) :] = 1
        do_sample = getattr(self.generation_config, "do_sample", True) is not False
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
        ):
            sampler = self._speculative_sampler(unwrapped_model, [len(p) for p in prompt_ids])
            out = sampler.generate(
                input_ids.to(device),
                attention_mask.to(device),
                max_new_tokens=self.max_completion_length,
                temperature=self.temperature,
                top_k=self.top_k or None,
                top_p=self.top_p,
                eos_token_id=list(self.eos_token_ids),
                pad_token_id=pad_id,
                do_sample=do_sample,
            )
        lengths = out.completion_lengths.tolist()
        completion_ids = [out.sequences[b, width : width + n].tolist() for b, n in enumerate(lengths)]
        stats = out.stats
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        for key, value in stats.as_metrics().items():
            metrics[key].append(value)
        return completion_ids, None

    def _mode_for(self, forest: PrefixForest) -> str:
        args = self.args
        if args.long_context_replay:
            return "replay"
        if args.tree_mode != "auto":
            return args.tree_mode
        if args.gradient_checkpointing or max(forest.lengths) > args.tree_replay_threshold:
            return "replay"
        return "keep"

    def _executor(self, model: torch.nn.Module, mode: str) -> TreeExecutor:
        model = self.accelerator.unwrap_model(model)
        key = (id(model), mode)
        if key not in self._tree_executors:
            args = self.args
            replay = mode == "replay"
            self._tree_executors[key] = TreeExecutor(
                model,
                mode=mode,
                block_size=(args.tree_block_size or _DEFAULT_BLOCK) if replay else args.tree_block_size,
                temperature=self.temperature,
                prompt_grad=args.long_context_prompt_grad if replay else "exact",
            )
        return self._tree_executors[key]

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
        """TRL's method; inside a tree step it returns the tree's leaves, and no-grad calls are tree-scored."""
        leaves = self._tree_leaves
        if leaves is not None:
            logps, entropies = leaves
            if tuple(logps.shape) != (input_ids.shape[0], logits_to_keep):
                raise RuntimeError(
                    f"tree step: the loss asked for log-probs of shape {(input_ids.shape[0], logits_to_keep)} but the "
                    f"micro-batch has {tuple(logps.shape)}"
                )
            return logps, (entropies if compute_entropy else None), None
        multimodal = any(v is not None for v in kwargs.values())
        if self.args.tree_enabled and not torch.is_grad_enabled() and not compute_aux_loss and not multimodal:
            return self._tree_score(model, input_ids, attention_mask, logits_to_keep, compute_entropy)
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
        if not self.args.tree_enabled:
            return super().training_step(model, inputs, num_items_in_batch)
        time_before = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        self._tree_window.append((inputs, num_items_in_batch))
        self._step += 1
        if (
            self.accelerator.sync_gradients
            or len(self._tree_window) >= self.current_gradient_accumulation_steps
        ):
            loss = self._tree_update(model)
        else:
            # The window's losses are returned, summed, by its last micro-batch (the logged total is the same).
            loss = torch.zeros((), device=self.args.device)
        self._current_train_step_time += time.perf_counter() - time_before
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    # ------------------------------------------------------------------ scoring
    def _tree_score(self, model, input_ids, attention_mask, logits_to_keep, compute_entropy):
        start = time.perf_counter()
        layout = from_padded(input_ids, attention_mask, logits_to_keep)
        forest = PrefixForest.build(layout.sequences, layout.score_from)
        executor = self._executor(model, "replay" if self.args.long_context_replay else "keep")
        with self.accelerator.autocast():
            res = executor.score(forest, entropy=compute_entropy)
        device = input_ids.device
        logps = scatter_rows(res.logprobs, layout.width).to(device)
        entropies = scatter_rows(res.entropies, layout.width).to(device) if compute_entropy else None
        self._tree_score_time += time.perf_counter() - start
        return logps, entropies, None

    # ------------------------------------------------------------------ the window's update
    def _tree_update(self, model) -> torch.Tensor:
        window, self._tree_window = self._tree_window, []
        layouts: list[RowLayout] = []
        for inputs, _ in window:
            present = [k for k in _MULTIMODAL_KEYS if inputs.get(k) is not None]
            if present:
                raise ValueError(
                    f"tree_packing is text-only but the batch carries {present}: turn tree_packing off"
                )
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            layouts.append(from_padded(input_ids, attention_mask, inputs["completion_ids"].shape[1]))
        sequences = [s for lay in layouts for s in lay.sequences]
        forest = PrefixForest.build(sequences, [f for lay in layouts for f in lay.score_from])
        mode = self._mode_for(forest)
        executor = self._executor(model, mode)
        score_time = self._tree_score_time
        self._tree_score_time = 0.0

        fused = self._tree_fused_ok and self._coefficients_constant(window)
        grads = None
        if fused:
            grads = self._constant_gradients(model, window, layouts)
            fused = grads is not None
        start = time.perf_counter()
        with self.accelerator.autocast():
            if fused:
                g_lp, g_ent = grads
                coef_lp = forest.scatter_add(g_lp).to(executor.device)
                coef_ent = forest.scatter_add(g_ent).to(executor.device) if g_ent is not None else None

                def coefficients(ids, logprobs, entropies):
                    return coef_lp[ids], (coef_ent[ids] if coef_ent is not None else None)

                res = executor.backward(forest, coefficient_fn=coefficients, entropy=True)
                backward_time = time.perf_counter() - start
                losses, _ = self._window_losses(
                    model, window, layouts, res.logprobs, res.entropies, grad=False
                )
            else:
                res = executor.score(forest, entropy=True)
                score_time += time.perf_counter() - start
                losses, leaves = self._window_losses(
                    model, window, layouts, res.logprobs, res.entropies, grad=True
                )
                total = torch.stack([loss.reshape(()) for loss in losses]).sum()
                if not torch.isfinite(total):
                    raise ValueError(
                        f"the GRPO loss is {total.item()} (NaN/inf) on this step's rollouts (e.g. NaN rewards or "
                        "advantages); nothing was accumulated"
                    )
                g_lp, g_ent = _leaf_gradients(total, leaves, layouts)
                start = time.perf_counter()
                executor.backward(forest, grad_logprobs=g_lp, grad_entropies=g_ent)
                backward_time = time.perf_counter() - start
        self._all_reduce_gradients(model)
        self._log_tree(forest, mode, backward_time, score_time)
        return torch.stack([loss.detach().reshape(()) for loss in losses]).sum()

    def _window_losses(self, model, window, layouts, logprobs, entropies, grad: bool):
        """TRL's ``compute_loss`` per micro-batch, on the tree's values as ``[B, C]`` leaves.

        Returns:
            (losses, leaves): one scalar per micro-batch, scaled as TRL's ``training_step``
            scales it before ``backward``; the ``(logps, entropies)`` leaves per micro-batch.
        """
        losses, leaves = [], []
        state = self.accelerator.gradient_state
        sync = state.sync_gradients
        offset = 0
        try:
            for i, ((inputs, num_items), lay) in enumerate(zip(window, layouts, strict=True)):
                n = len(lay.scored)
                device = inputs["completion_ids"].device
                lp = scatter_rows(logprobs[offset : offset + n], lay.width).to(device)
                ent = scatter_rows(entropies[offset : offset + n], lay.width).to(device)
                offset += n
                lp.requires_grad_(grad)
                ent.requires_grad_(grad)
                leaves.append((lp, ent))
                self._tree_leaves = (lp, ent)
                # TRL's loss does its once-per-optimizer-step work (adaptive entropy) on the last micro-batch.
                state._set_sync_gradients(sync and i == len(window) - 1)
                with torch.set_grad_enabled(grad), self.compute_loss_context_manager():
                    loss = self.compute_loss(model, inputs, num_items_in_batch=num_items)
                losses.append(self._scale_like_training_step(loss, num_items))
        finally:
            self._tree_leaves = None
            state._set_sync_gradients(sync)
        return losses, leaves

    def _scale_like_training_step(self, loss: torch.Tensor, num_items) -> torch.Tensor:
        # transformers' Trainer.training_step divides by the accumulation steps unless the loss says
        # it is already scaled (TRL's GRPO sets loss_is_scaled_for_ga = True).
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items is not None
            ) or self.compute_loss_func is not None
        return loss if scaled else loss / self.current_gradient_accumulation_steps

    # ------------------------------------------------------------------ fused path
    def _coefficients_constant(self, window) -> bool:
        """Whether the host loss's gradient w.r.t. log-probs/entropies is the same at any values
        (then one fused pass suffices). The mixin assumes not; hosts that know better override."""
        return False

    def _own_loss(self) -> bool:
        """The loss is the TRL base class's own code (not a user subclass's override)."""
        cls, base = type(self), self._trl_base
        return cls._compute_loss is base._compute_loss and cls.compute_loss is base.compute_loss

    def _constant_gradients(self, model, window, layouts):
        """TRL's loss gradient, evaluated (quietly) at two points; None if they differ."""
        probes = []
        for value in (0.0, -1.0):
            lps, ents = [], []
            for lay in layouts:
                for n in lay.scored:
                    ramp = torch.arange(n, dtype=torch.float32)
                    lps.append(value * (1.0 + 0.01 * ramp))
                    ents.append(-value * (1.0 + 0.02 * ramp))
            with self._quiet():
                losses, leaves = self._window_losses(model, window, layouts, lps, ents, grad=True)
                loss = torch.stack([x.reshape(()) for x in losses]).sum()
                probes.append(_leaf_gradients(loss, leaves, layouts))
        (lp0, ent0), (lp1, ent1) = probes
        pairs = list(zip(lp0, lp1, strict=True)) + list(zip(ent0 or [], ent1 or [], strict=True))
        if (ent0 is None) != (ent1 is None) or not all(torch.equal(a, b) for a, b in pairs):
            logger.info(
                "the loss gradient depends on the log-prob values in this configuration: forkrl adds a "
                "scoring pass before the tree backward from now on"
            )
            self._tree_fused_ok = False
            return None
        for t in lp0 + (ent0 or []):
            if not torch.isfinite(t).all():
                raise ValueError(
                    "the loss gradient is NaN/inf for some tokens (e.g. NaN rewards or advantages); nothing was "
                    "accumulated"
                )
        return lp0, ent0

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Evaluate TRL's loss without side effects: metrics go to a scratch dict and any attribute
        the loss reassigns (adaptive-entropy state) is restored."""
        saved = dict(vars(self))
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        try:
            yield
        finally:
            for key, value in saved.items():
                if getattr(self, key, None) is not value:
                    setattr(self, key, value)

    # ------------------------------------------------------------------ data parallel, metrics
    def _all_reduce_gradients(self, model, bucket_elems: int = 1 << 25) -> None:
        """Average gradients over data-parallel ranks, as DDP's hooks would have (the tree pass runs on
        the unwrapped module, so the hooks do not fire)."""
        world = self.accelerator.num_processes
        if world == 1 or not dist.is_available() or not dist.is_initialized():
            return
        params = [p for p in self.accelerator.unwrap_model(model).parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []
        size = 0
        for p in params + [None]:
            if p is not None:
                bucket.append(p.grad)
                size += p.grad.numel()
            if bucket and (p is None or size >= bucket_elems):
                flat = torch.cat([g.reshape(-1) for g in bucket])
                dist.all_reduce(flat)
                flat /= world
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
                bucket, size = [], 0

    def _log_tree(self, forest: PrefixForest, mode: str, backward_time: float, score_time: float) -> None:
        stats = torch.tensor(
            [[forest.unique_tokens, forest.dense_tokens, backward_time, score_time]],
            dtype=torch.float64,
            device=self.accelerator.device,
        )
        stats = self.accelerator.gather(stats).view(-1, 4)
        unique, dense = stats[:, 0].sum().item(), stats[:, 1].sum().item()
        metrics = self._metrics["train"]
        metrics["tree/compression"].append(dense / max(unique, 1.0))
        metrics["tree/unique_tokens"].append(unique)
        metrics["tree/dense_tokens"].append(dense)
        metrics["tree/mode"].append(float(MODE_CODES[mode]))
        metrics["tree/backward_time"].append(stats[:, 2].max().item())
        metrics["tree/score_time"].append(stats[:, 3].max().item())


def _leaf_gradients(loss: torch.Tensor, leaves, layouts: list[RowLayout]):
    """d loss / d (log-prob, entropy) leaves, cut back to per-sequence ``[n_i]`` tensors (CPU).

    Returns:
        (per-sequence log-prob gradients, per-sequence entropy gradients or None when all zero).
    """
    flat = [t for pair in leaves for t in pair]
    grads = torch.autograd.grad(loss, flat, allow_unused=True)
    g_lp, g_ent = [], []
    for i, lay in enumerate(layouts):
        for out, g, leaf in ((g_lp, grads[2 * i], flat[2 * i]), (g_ent, grads[2 * i + 1], flat[2 * i + 1])):
            g = g if g is not None else torch.zeros_like(leaf)
            out += gather_rows(g.detach().cpu(), lay.scored)
    return g_lp, (g_ent if any(bool(t.any()) for t in g_ent) else None)


class GRPOTrainer(TreeTrainingMixin, _TRLGRPOTrainer):
    """TRL's ``GRPOTrainer`` with forkrl's tree training.

    Used exactly like ``trl.GRPOTrainer``; pass ``args=forkrl.plugins.trl.GRPOConfig(...,
    tree_packing=True)``, or forkrl's options as keyword arguments
    (``GRPOTrainer(model, reward_funcs, args=trl_args, tree_packing=True)``), which are merged into a
    copy of ``args``.
    """

    _trl_base = _TRLGRPOTrainer
    _config_class = GRPOConfig

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
