"""Tiny, fully local TRL setups: a byte-level tokenizer, a tiny Llama saved to disk, a deterministic
``rollout_func`` whose completions share openings, repeat and vary in length, and a runner that
trains stock ``trl.GRPOTrainer`` and forkrl's plugin on the same rollouts: :func:`train`, the
equals-stock entry point every host's test support has (compared by :mod:`forkrl.core.testing.stock`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from forkrl.core.testing.models import (
    BYTE_EOS,
    BYTE_PAD,
    BYTE_VOCAB,
    byte_llama,
    byte_tokenizer,
    save_pretrained,
)

PAD, EOS, VOCAB = BYTE_PAD, BYTE_EOS, BYTE_VOCAB


def save_tiny_llama(path: Path, seed: int = 0, **overrides: Any) -> str:
    """A tiny Llama (GQA, hidden 32) and the byte tokenizer saved under ``path``; returns the path."""
    return save_pretrained(byte_llama(seed, **overrides), byte_tokenizer(), path)


SYSTEM = "You are a careful assistant. Answer with letters only. "


def prompt_dataset(n: int = 8, long: int = 0) -> Dataset:
    """Prompts that share a system opening (cross-group prefix sharing); ``long`` pads them."""
    words = ["apple", "banana", "cherry", "date", "elder", "fig", "grape", "hazel", "iris", "jade"]
    prompts = [
        SYSTEM + (" context" * long) + f" Question {i}: spell {words[i % len(words)]}." for i in range(n)
    ]
    return Dataset.from_dict({"prompt": prompts})


def make_rollout_func(tool_mask: bool = False, truncate_some: bool = False) -> Callable:
    """Deterministic rollouts: completion k of a prompt starts with the group's shared opening cut at a
    k-dependent point, k=0 and k=1 are identical, lengths vary, most end with EOS."""

    def rollout(prompts: list[str], trainer) -> dict[str, Any]:
        tok = trainer.processing_class
        seen: dict[str, int] = {}
        out: dict[str, Any] = {"prompt_ids": [], "completion_ids": [], "logprobs": None}
        env_masks = []
        for p in prompts:
            k = seen.get(p, 0)
            seen[p] = k + 1
            ids = tok(p, add_special_tokens=False)["input_ids"]
            rng = random.Random(sum(ids) * 31 + 7)
            opening = [rng.randrange(97, 123) for _ in range(12)]
            kk = 0 if k == 1 else k
            r = random.Random(sum(ids) * 131 + kk)
            cut = (0, 4, 8, 12)[kk % 4]
            tail = [r.randrange(97, 123) for _ in range(r.randrange(1, 9))]
            comp = opening[:cut] + tail
            max_len = trainer.max_completion_length
            ends = not (truncate_some and kk % 3 == 2)
            comp = comp[: max_len - 1] + [EOS] if ends else (comp * 4)[:max_len]
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(comp)
            if tool_mask:
                env_masks.append([0 if 3 <= j < 6 else 1 for j in range(len(comp))])
        if tool_mask:
            out["env_mask"] = env_masks
        return out

    return rollout


def letter_reward(completions, completion_ids, **kwargs) -> list[float]:
    """Fraction of the completion's tokens that are 'a'..'e' (learnable, varies within groups)."""
    return [sum(1 for t in ids if 97 <= t <= 101) / max(1, len(ids)) for ids in completion_ids]


def base_args(out: Path, **kw: Any) -> dict[str, Any]:
    args = dict(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=24,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        seed=7,
        gradient_checkpointing=False,
        disable_dropout=True,
        dataloader_num_workers=0,
    )
    args.update(kw)
    return args


def train(
    model_path: str,
    out: Path,
    forkrl: bool,
    rollout: Callable | None = None,
    dataset: Dataset | None = None,
    peft_config: Any = None,
    trainer_hook: Callable | None = None,
    eval_dataset: Dataset | None = None,
    **kw: Any,
) -> tuple[dict[str, torch.Tensor], Any]:
    """Train stock TRL (forkrl=False) or forkrl's plugin with tree_packing (forkrl=True); returns the
    final trainable parameters and the trainer."""
    import trl

    from forkrl.plugins import trl as ftrl

    tree = {k: kw.pop(k) for k in list(kw) if k.startswith("tree_") or k.startswith("long_context")}
    if forkrl:
        tree.setdefault("tree_packing", True)
        args = ftrl.GRPOConfig(**base_args(out, **kw), **tree)
        cls = ftrl.GRPOTrainer
    else:
        args = trl.GRPOConfig(**base_args(out, **kw))
        cls = trl.GRPOTrainer
    trainer = cls(
        model=model_path,
        reward_funcs=letter_reward,
        args=args,
        train_dataset=dataset if dataset is not None else prompt_dataset(),
        eval_dataset=eval_dataset,
        rollout_func=rollout or make_rollout_func(),
        peft_config=peft_config,
    )
    if trainer_hook is not None:
        trainer_hook(trainer)
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return params, trainer


def initial_params(model_path: str) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_path)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_rloo(model_path: str, out: Path, forkrl: bool, **kw: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Stock ``trl.RLOOTrainer`` or forkrl's with tree_packing, TRL's own seeded generation (short
    completions); returns the final parameters and the trainer."""
    import trl

    from forkrl.plugins import trl as ftrl

    tree = {k: kw.pop(k) for k in list(kw) if k.startswith("tree_") or k.startswith("long_context")}
    args = base_args(out, max_completion_length=10, **kw)
    if forkrl:
        args, cls = ftrl.RLOOConfig(**args, **{"tree_packing": True, **tree}), ftrl.RLOOTrainer
    else:
        args, cls = trl.RLOOConfig(**args), trl.RLOOTrainer
    trainer = cls(model=model_path, reward_funcs=letter_reward, args=args, train_dataset=prompt_dataset())
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer


#: speculative_rollout on every step, drafts of 3 tokens (the TRL speculative and precision tests).
SPEC = dict(
    speculative_rollout=True, speculative_group_size=32, speculative_policy="always", speculative_draft_len=3
)


def letter_share(completion: list[int]) -> float:
    """The share of a completion's tokens that are the letters a..e."""
    return sum(1 for t in completion if 97 <= t <= 101) / max(1, len(completion))


def run_recording_rollouts(
    model_path: str, out: Path, forkrl: bool, seen: list, score: Callable = letter_share, **kw: Any
) -> tuple[dict[str, torch.Tensor], Any]:
    """Train stock TRL (forkrl=False) or the plugin (forkrl=True, its ``speculative*``/``tree*``
    options from ``kw``) with completions of up to 10 tokens, appending every completion the reward
    sees to ``seen``; returns all parameters and the trainer."""
    import trl

    from forkrl.plugins import trl as ftrl

    def reward(completion_ids, **_):
        seen.extend(tuple(c) for c in completion_ids)
        return [score(c) for c in completion_ids]

    spec = {k: kw.pop(k) for k in list(kw) if k.startswith("speculative") or k.startswith("tree")}
    args = base_args(out, max_completion_length=10, **kw)
    if forkrl:
        config, cls = ftrl.GRPOConfig(**args, **spec), ftrl.GRPOTrainer
    else:
        config, cls = trl.GRPOConfig(**args), trl.GRPOTrainer
    trainer = cls(model=model_path, reward_funcs=reward, args=config, train_dataset=prompt_dataset())
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer
