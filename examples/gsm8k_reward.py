"""GSM8K's answer check as OpenRLHF's custom reward (``--reward.remote_url examples/gsm8k_reward.py``).

OpenRLHF calls ``reward_func(queries, prompts, labels)`` with the decoded prompt + response texts,
the prompts and GSM8K's ``answer`` fields (``--data.label_key answer``); the reward is 1 when the
last number of the response equals the number after the label's ``####``, else 0.
"""

from __future__ import annotations

import re

import torch

_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """Per sample 1.0 if the response's last number is the label's answer, else 0.0."""
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels, strict=True):
        response = query[len(prompt) :] if query.startswith(prompt) else query
        answer = label.split("####")[-1].strip().replace(",", "")
        rewards.append(float(_last_number(response) == answer))
    scores = torch.tensor(rewards)
    return {"rewards": scores, "scores": scores, "extra_logs": {"accuracy": scores.mean()}}
