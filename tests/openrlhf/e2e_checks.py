"""What the end-to-end runs of OpenRLHF share (tests/openrlhf/test_openrlhf_e2e*.py): their inputs,
and what every run must show."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from forkrl.core.testing.models import byte_llama, byte_tokenizer, save_pretrained
from forkrl.plugins.openrlhf.testing_e2e import PROMPTS_PER_STEP
from forkrl.plugins.openrlhf.testing_e2e import saved_parameters as _parameters

STEPS = 2


def assert_trained(data: dict, run: dict) -> None:
    """Every weight matrix of the saved model differs from the initial one, beyond the rounding of
    OpenRLHF's bf16 parameters (the initial model is float32)."""
    init = {n: p.bfloat16().float() for n, p in _parameters(data["model"]).items()}
    final = _parameters(run["out"] / "final")
    assert final.keys() == init.keys()
    unchanged = [n for n, p in final.items() if p.dim() == 2 and torch.equal(p, init[n])]
    assert not unchanged, unchanged
    assert max((final[n] - init[n]).abs().max().item() for n in init) > 1e-3


#: The tiny Llama's shape: attention heads of 32 (vLLM's CPU attention has no smaller kernel).
VLLM_SHAPE = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)


def build_data(root: Path) -> dict:
    """Under ``root``: the tiny model and byte tokenizer saved to disk, and a prompt file for exactly
    ``STEPS`` steps; ``peaked``: the same model with a sharper head (the drafter's tokens then get accepted at
    temperature 1, where vLLM's greedy drafts of a near-uniform policy almost never are)."""
    model = save_pretrained(byte_llama(0, **VLLM_SHAPE), byte_tokenizer(), root / "model")
    peaked = byte_llama(0, **VLLM_SHAPE)
    with torch.no_grad():
        peaked.lm_head.weight.mul_(6)
    prompts = root / "prompts.jsonl"
    rows = [{"input": f"{7 * i}+{i + 3}="} for i in range(STEPS * PROMPTS_PER_STEP)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {
        "model": model,
        "peaked": save_pretrained(peaked, byte_tokenizer(), root / "peaked"),
        "prompts": prompts,
        "hf_home": root / "hf",
    }


def vllm_loads(log: str) -> list[int]:
    """The vLLM rollout's weight syncs: the parameters each one loaded into the engine."""
    return [int(m[2]) for m in re.finditer(r"cpu vllm rollout: load #(\d+): (\d+) parameters", log)]
