"""The end-to-end runs' reward, in each host's custom-reward form: the fraction of the response's
characters that are digits. A tiny random model earns a spread of such rewards in every group, so
GRPO's group-normalised advantages are nonzero from the first step (an exact-match reward would give
all-zero groups), and it learns it in about 50 steps (``benchmarks/learning_curve_hosts.py``).

The hosts load this file by its path (:data:`PATH`): veRL's ``reward.custom_reward_function.path``
calls :func:`compute_score`, OpenRLHF's ``--reward.remote_url`` calls :func:`reward_func`.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["PATH", "compute_score", "digit_fraction", "reward_func"]

#: This file, for the hosts' reward options.
PATH = Path(__file__)

#: The tiny byte tokenizer's special tokens, as they appear in OpenRLHF's decoded text.
SPECIAL = ("<eos>", "<pad>")


def digit_fraction(response: str) -> float:
    """Digits / characters of ``response`` without special tokens (0 for an empty response)."""
    for token in SPECIAL:
        response = response.replace(token, "")
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """veRL's form: the digit fraction of the decoded response ``solution_str``, as it comes."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """OpenRLHF's form, given the decoded prompt + response texts: per sample, its response's digit fraction."""
    del labels
    rewards = torch.tensor(
        [
            digit_fraction(query[len(prompt) :] if query.startswith(prompt) else query)
            for query, prompt in zip(queries, prompts, strict=True)
        ]
    )
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"digit_fraction": rewards.mean()}}
