"""A self-drafting rollout engine kept in step with the policy across optimizer steps.

The host calls :meth:`SelfSpeculativeRollout.sampler` before each rollout with its current
optimizer step: the first call builds the drafter (and, with the ``auto`` policy, calibrates the
cost model on the host's prompt lengths), every later step re-derives the drafter from the current
weights in place, so it never drifts from the policy.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch
from torch import nn

from ..quant import Drafter
from .hf import SpeculativeSampler
from .options import SpeculativeOptions
from .policy import SpeculationPolicy

__all__ = ["SelfSpeculativeRollout", "check_drafter"]

_CALIBRATION_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


class SelfSpeculativeRollout:
    """The sampler of a host's rollouts, its drafter refreshed once per optimizer step.

    Args:
        options: the host's speculative options.
        temperature, top_k, top_p: the host's sampling settings (calibration times their warping).
        max_new_tokens: the host's completion budget (calibration context).
    """

    def __init__(
        self,
        options: SpeculativeOptions,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        max_new_tokens: int = 256,
    ) -> None:
        self.options = options.speculative_options()
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.max_new_tokens = max_new_tokens
        self._sampler: SpeculativeSampler | None = None
        self._step: int | None = None
        self.refreshes = 0

    @property
    def current(self) -> SpeculativeSampler | None:
        """The sampler built so far (None before the first rollout)."""
        return self._sampler

    def check_model(self, model: nn.Module) -> None:
        """Raise ValueError now, naming ``speculative_bits``/``speculative_group_size``, when the
        drafter could not quantize ``model`` (the unwrapped policy): at setup, not at the first rollout."""
        check_drafter(self.options, model)

    def sampler(self, model: nn.Module, step: int, prompt_lengths: Sequence[int]) -> SpeculativeSampler:
        """The sampler for a rollout at optimizer step ``step`` of ``model`` (the unwrapped policy)."""
        if self._sampler is None:
            self._sampler = self._build(model, prompt_lengths)
        elif step != self._step:
            self._sampler.drafter.refresh(model)
            self.refreshes += 1
        self._step = step
        return self._sampler

    def _build(self, model: nn.Module, prompt_lengths: Sequence[int]) -> SpeculativeSampler:
        opts = self.options
        dtype = next(model.parameters()).dtype
        drafter = Drafter.from_policy(
            model,
            bits=opts.speculative_bits,
            group_size=opts.drafter_group_size,
            compute_dtype=torch.bfloat16 if dtype == torch.float32 else dtype,
        )
        if opts.speculative_policy == "always":
            policy = SpeculationPolicy.fixed(opts.draft_len)
        else:
            context = int(statistics.median_high(prompt_lengths)) + self.max_new_tokens // 2
            sizes = [b for b in _CALIBRATION_BATCHES if b <= max(1, len(prompt_lengths))]
            policy = SpeculationPolicy.calibrate(
                model,
                drafter,
                batch_sizes=sizes,
                context_len=context,
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                margin=opts.margin,
            )
        return SpeculativeSampler(model, drafter, policy)


def check_drafter(options: SpeculativeOptions, model: nn.Module) -> None:
    """Raise ValueError, in the option names every host shares, when ``options``' drafter settings
    cannot quantize ``model`` (e.g. a hidden size the default group of 128 does not divide)."""
    opts = options.speculative_options()
    try:
        Drafter.check(model, bits=opts.speculative_bits, group_size=opts.drafter_group_size)
    except ValueError as err:
        setting = f"speculative_bits={opts.speculative_bits}"
        if opts.speculative_bits == 4:
            setting += f", speculative_group_size={opts.drafter_group_size or 128}"
        raise ValueError(
            f"speculative_rollout cannot build its drafter with {setting}: {err} (set speculative_group_size or "
            "speculative_bits accordingly, or speculative_rollout=False)"
        ) from None
