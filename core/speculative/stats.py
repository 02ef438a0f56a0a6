"""What a ``generate`` call reports: its figures and its output."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .policy import Decision

__all__ = ["METRIC_PREFIX", "SpeculativeOutput", "SpeculativeStats"]

#: The one prefix of speculation metrics in every host's logs.
METRIC_PREFIX = "spec/"


@dataclass
class SpeculativeStats:
    """Figures of one ``generate`` call (detached Python numbers, ready for a metrics dict).

    Attributes:
        proposed: draft tokens proposed, over rows and steps.
        accepted: draft tokens accepted.
        acceptance_rate: accepted / proposed (nan without speculation).
        mean_accepted_length: mean tokens emitted per row per speculative step (accepted drafts + 1).
        draft_length_history: k of every decode step after the prefill (0 = plain step).
        batch_size_history: active rows at every decode step.
        speculated_fraction: fraction of decode steps that speculated.
        target_calls: target forwards (including the prefill).
        drafter_calls: drafter forwards.
        wall_time_s: seconds in ``generate``.
        generated_tokens: completion tokens returned (sum of completion_lengths).
        decisions: the policy's choice at every decode step (k, predicted speedup, alpha, batch).
        kernel: the drafter's kernel path ("int4-native", "int8-native", "...-dequant" or "none").
        policy_mode: "auto", "fixed" or "never".
        final_alpha: the policy's acceptance estimate at the end.
    """

    proposed: int = 0
    accepted: int = 0
    acceptance_rate: float = float("nan")
    mean_accepted_length: float = float("nan")
    draft_length_history: list[int] = field(default_factory=list)
    batch_size_history: list[int] = field(default_factory=list)
    speculated_fraction: float = 0.0
    target_calls: int = 0
    drafter_calls: int = 0
    wall_time_s: float = 0.0
    generated_tokens: int = 0
    decisions: list[Decision] = field(default_factory=list)
    kernel: str = "none"
    policy_mode: str = "never"
    final_alpha: float = float("nan")
    _spec_row_steps: int = 0

    def as_metrics(self, prefix: str = METRIC_PREFIX) -> dict[str, float]:
        """Scalar figures for a host's metrics dict, under one prefix (``spec/`` in every host).

        ``acceptance`` (accepted / proposed drafts), ``speculated_fraction`` (decode steps that
        speculated), ``draft_len`` (mean k of those steps), ``mean_accepted_length``,
        ``rollout_time`` (seconds), ``target_calls``, ``drafter_calls``, ``generated_tokens``,
        ``final_alpha`` (the policy's acceptance estimate).
        """
        hist = [k for k in self.draft_length_history if k]
        values = {
            "acceptance": self.acceptance_rate,
            "speculated_fraction": self.speculated_fraction,
            "draft_len": sum(hist) / len(hist) if hist else 0.0,
            "mean_accepted_length": self.mean_accepted_length,
            "rollout_time": self.wall_time_s,
            "target_calls": self.target_calls,
            "drafter_calls": self.drafter_calls,
            "generated_tokens": self.generated_tokens,
            "final_alpha": self.final_alpha,
        }
        return {prefix + k: float(v) for k, v in values.items()}

    def to_dict(self) -> dict:
        """All fields as plain Python (decisions as dicts)."""
        d = asdict(self)
        d.pop("_spec_row_steps")
        return d


@dataclass
class SpeculativeOutput:
    """Result of :meth:`SpeculativeSampler.generate`.

    Attributes:
        sequences: ``[B, P + T]`` the prompt as given (left-padded) then the completion, right-
            padded with ``pad_token_id``; ``T`` is the longest completion (the layout of HF generate).
        completion_lengths: ``[B]`` completion tokens per row, including the EOS token if emitted.
        stats: figures of the call.
    """

    sequences: torch.Tensor
    completion_lengths: torch.Tensor
    stats: SpeculativeStats
