"""Test-only: a dense reward for OpenRLHF's custom reward mechanism (``--reward.remote_url <this file>``).

OpenRLHF calls ``reward_func(queries, prompts, labels)`` with the decoded prompt + response texts;
the reward is the fraction of the response's characters that are digits (special tokens removed).
A random tiny model earns a spread of such rewards in every group, so GRPO's group-normalised
advantages are nonzero from the first step (an exact-match reward would give all-zero groups).
"""

from __future__ import annotations

import torch

#: The tiny byte tokenizer's special tokens, as they appear in the decoded text.
SPECIAL = ("<eos>", "<pad>")


def digit_fraction(response: str) -> float:
    """Digits / characters of ``response`` without special tokens (0 for an empty response)."""
    for token in SPECIAL:
        response = response.replace(token, "")
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """Per sample, the digit fraction of its response."""
    del labels
    rewards = torch.tensor(
        [
            digit_fraction(query[len(prompt) :] if query.startswith(prompt) else query)
            for query, prompt in zip(queries, prompts, strict=True)
        ]
    )
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"digit_fraction": rewards.mean()}}
