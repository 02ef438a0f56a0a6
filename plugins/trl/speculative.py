"""``speculative_rollout`` for TRL: :class:`TRLSpeculation`, the generation side a trainer holds.

A trainer with ``speculative_rollout`` holds one (``self.forkrl_spec``, as it holds its
:class:`~forkrl.core.train.TreeRunner` in ``self.forkrl``) and hands it TRL's
``_generate_single_turn``:

- with TRL's transformers generation, the exact self-speculative sampler
  (:class:`forkrl.core.speculative.SelfSpeculativeRollout`, its drafter re-derived from the policy
  once per optimizer step) generates text-only prompts; images go to TRL's own generation;
- with ``use_vllm``, TRL's vLLM engine generates and drafts with forkrl's drafter
  (:mod:`.vllm_speculative`; colocated, TRL builds the engine with forkrl's arguments,
  :meth:`TRLSpeculation.engine_arguments`), and the figures are read from vLLM's counters.

Either way the ``spec/*`` figures go to TRL's metrics ("train" or "eval", as the model is).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from forkrl.core.speculative import SelfSpeculativeRollout, SpeculativeSampler, check_drafter
from forkrl.plugins.vllm.speculative import spec_decode_metrics

from . import compat, vllm_speculative

if TYPE_CHECKING:
    from .trainer import TreeTrainingMixin

__all__ = ["TRLSpeculation"]

logger = logging.getLogger(__name__)


class TRLSpeculation:
    """A TRL trainer's speculative generation (module docstring).

    Attributes:
        trainer: the trainer it generates for.
        vllm: TRL generates with vLLM (``use_vllm``), which drafts with forkrl's drafter.
        rollout: the transformers sampler and its drafter (built by :meth:`setup`; None under vLLM).
        warned: the warning that vLLM drafted nothing was given (once per run).
    """

    def __init__(self, trainer: TreeTrainingMixin, config: Any) -> None:
        self.trainer = trainer
        self.vllm = bool(config.use_vllm)
        self.rollout: SelfSpeculativeRollout | None = None
        self.warned = False

    def engine_arguments(self, config: Any) -> AbstractContextManager:
        """Around TRL's ``__init__``: a colocated vLLM engine gets forkrl's speculative config."""
        if not (self.vllm and config.vllm_mode == "colocate"):
            return contextlib.nullcontext()
        return compat.vllm_engine_kwargs(
            vllm_speculative.colocate_engine_kwargs(config, lambda: self.trainer.model)
        )

    def setup(self) -> None:
        """After TRL's ``__init__``: refuse what the drafter cannot serve, then build the sampler.

        Raises:
            ValueError: for a PEFT adapter, a vision-language model or a policy the drafter cannot
                quantize, naming the way out.
        """
        trainer = self.trainer
        model = trainer._unwrapped(trainer.model)
        if hasattr(model, "peft_config"):
            raise ValueError(
                "speculative_rollout does not support PEFT adapters yet (the drafter quantizes the base weights, not "
                "base + adapter): merge the adapter or set speculative_rollout=False"
            )
        if trainer._is_vlm:
            raise ValueError("speculative_rollout supports text-only models: set speculative_rollout=False")
        check_drafter(trainer.args, model)
        if not self.vllm:
            self.rollout = SelfSpeculativeRollout(
                trainer.args,
                temperature=trainer.temperature,
                top_k=trainer.top_k or None,
                top_p=trainer.top_p,
                max_new_tokens=trainer.max_completion_length,
            )

    def generate(
        self, stock: Callable[..., Any], prompt_ids, images, multimodal_fields, *args: Any, **kwargs: Any
    ):
        """TRL's ``_generate_single_turn`` (``stock``, the trainer's inherited one) with speculation."""
        if self.vllm:
            return self._generate_vllm(stock, prompt_ids, images, multimodal_fields, *args, **kwargs)
        if images is not None or multimodal_fields:
            return stock(prompt_ids, images, multimodal_fields, *args, **kwargs)
        trainer = self.trainer
        pad_id = trainer._tokenizer.pad_token_id
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for b, ids in enumerate(prompt_ids):
            input_ids[b, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[b, width - len(ids) :] = 1
        device = trainer.accelerator.device
        with compat.unwrap_for_generation(trainer) as unwrapped_model, torch.no_grad():
            sampler = self.sampler(unwrapped_model, [len(p) for p in prompt_ids])
            out = sampler.generate(
                input_ids.to(device),
                attention_mask.to(device),
                max_new_tokens=trainer.max_completion_length,
                temperature=trainer.temperature,
                top_k=trainer.top_k or None,
                top_p=trainer.top_p,
                eos_token_id=list(trainer.eos_token_ids),
                pad_token_id=pad_id,
                do_sample=getattr(trainer.generation_config, "do_sample", True) is not False,
            )
        lengths = out.completion_lengths.tolist()
        self._record(out.stats.as_metrics())
        return [out.sequences[b, width : width + n].tolist() for b, n in enumerate(lengths)], None

    def sampler(self, model: torch.nn.Module, prompt_lengths: list[int]) -> SpeculativeSampler:
        """The sampler, its drafter re-derived from the current weights once per optimizer step."""
        return self.rollout.sampler(model, self.trainer.state.global_step, prompt_lengths)

    def _generate_vllm(self, stock: Callable[..., Any], *args: Any, **kwargs: Any):
        """TRL's vLLM generation (vLLM drafts with forkrl's drafter), its ``spec/*`` figures from vLLM's counters."""
        generation = compat.vllm_generation(self.trainer)
        before = vllm_speculative.counters(generation)
        start = time.perf_counter()
        out = stock(*args, **kwargs)
        elapsed = time.perf_counter() - start
        after = vllm_speculative.counters(generation) if before is not None else None
        figures = spec_decode_metrics(before, after) if after is not None else {}
        if after is not None and not figures and not self.warned:
            self.warned = True
            logger.warning(
                "speculative_rollout: vLLM drafted nothing in this rollout; in server mode start the server with "
                "`python -m forkrl.plugins.trl.vllm_serve` (see its docstring)"
            )
        self._record({"spec/rollout_time": elapsed, **figures})
        return out

    def _record(self, figures: dict[str, float]) -> None:
        """The figures into TRL's metrics of the current mode."""
        sink = compat.metrics(self.trainer, "train" if self.trainer.model.training else "eval")
        for key, value in figures.items():
            sink[key].append(value)
