"""GRPO in TRL with forkrl's tree packing, on a synthetic task with long shared prompts (CPU, minutes).

Every prompt is a long shared "document" followed by a short question naming a set of letters; the
reward is the fraction of the completion's characters in that set. Each optimizer step samples
G completions per prompt with TRL's own generation and trains them with
``GRPOTrainer(..., tree_packing=True)``: the document, each prompt and each shared completion
opening are computed once, and the update is the one stock TRL would make. The script first runs a
few steps of stock ``trl.GRPOTrainer`` and of the plugin from the same weights to compare the time
per optimizer step, then trains with the plugin and prints the reward.

    bash scripts/setup.sh run && .venv/bin/python examples/trl_grpo_tree.py
    .venv/bin/python examples/trl_grpo_tree.py --steps 60 --doc-len 2048
    .venv/bin/python examples/trl_grpo_tree.py --model Qwen/Qwen2.5-0.5B-Instruct --device cuda --bf16
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path

log = logging.getLogger("trl_grpo_tree")
LETTER_SETS = ("abcd", "wxyz")


def tiny_model(path: Path, seed: int = 0) -> str:
    """A tiny Llama (hidden 64, 2 layers) and the byte tokenizer saved under ``path``."""
    from forkrl.core.testing.models import byte_llama, byte_tokenizer, save_pretrained

    model = byte_llama(seed, hidden_size=64, intermediate_size=172, max_position_embeddings=8192)
    return save_pretrained(model, byte_tokenizer(), path)


def quiet_libraries() -> None:
    """The script's output is its own summary: the libraries' progress bars, deprecation notices
    (TRL 1.16 and transformers 5 warn about each other's renamed checkpointing API) and info logs
    are silenced here, at the entry point, never in library code."""
    import torch
    import transformers

    if not torch.cuda.is_available():
        # DeepSpeed (imported through accelerate) warns when it falls back to the CPU; here the CPU is asked for.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings(
        "ignore", category=FutureWarning, module=r"(transformers|trl|peft|accelerate)(\.|$)"
    )
    for noisy in ("transformers", "trl", "accelerate", "datasets"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def dataset(n: int, doc_len: int, seed: int = 0):
    from datasets import Dataset

    rng = random.Random(seed)
    words = ["tree", "prefix", "token", "group", "cache", "branch", "policy", "reward", "step", "leaf"]
    doc = ""
    while len(doc) < doc_len:
        doc += rng.choice(words) + " "
    doc = doc[:doc_len]
    sets = [LETTER_SETS[i % len(LETTER_SETS)] for i in range(n)]
    rows = [{"prompt": f"{doc}\nQ{i}: write letters from {s}.\nA:", "letters": s} for i, s in enumerate(sets)]
    return Dataset.from_list(rows)


def letter_reward(completions, letters, **kwargs):
    """Fraction of the completion's characters in the prompt's letter set."""
    return [
        sum(ch in want for ch in text) / max(1, len(text))
        for text, want in zip(completions, letters, strict=True)
    ]


def make_trainer(args, model_path: str, out: Path, tree: bool, steps: int, train_set):
    import trl
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from forkrl.plugins import trl as ftrl

    config = dict(
        output_dir=str(out),
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        max_steps=steps,
        per_device_train_batch_size=args.group,
        gradient_accumulation_steps=args.prompts,
        num_generations=args.group,
        max_completion_length=args.max_new,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        gradient_checkpointing=False,
        seed=args.seed,
    )
    if tree:
        cfg, cls = ftrl.GRPOConfig(**config, tree_packing=True), ftrl.GRPOTrainer
    else:
        cfg, cls = trl.GRPOConfig(**config), trl.GRPOTrainer
    trainer = cls(model=model_path, reward_funcs=letter_reward, args=cfg, train_dataset=train_set)
    for callback in (ProgressCallback, PrinterCallback):  # this script prints its own summary
        trainer.remove_callback(callback)
    return trainer


def timed_steps(trainer) -> list[float]:
    from transformers import TrainerCallback

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

    trainer.add_callback(Timer())
    trainer.train()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="a Hugging Face model id (default: a tiny Llama built here)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--steps", type=int, default=40, help="training steps with tree packing")
    ap.add_argument(
        "--compare-steps", type=int, default=3, help="steps of stock TRL vs plugin for the timing"
    )
    ap.add_argument(
        "--doc-len",
        type=int,
        default=1024,
        help="characters (= tokens for the tiny model) of the shared document",
    )
    ap.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--summary", default=None, help="also write the logged steps and rewards here, as JSON")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    quiet_libraries()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_path = args.model or tiny_model(tmp / "model", args.seed)
        n = args.prompts * max(args.steps, args.compare_steps)
        train_set = dataset(n, args.doc_len, args.seed)

        per_step = {}
        if args.compare_steps > 0:
            for name, tree in (("stock TRL", False), ("forkrl tree_packing", True)):
                trainer = make_trainer(args, model_path, tmp / name, tree, args.compare_steps, train_set)
                times = timed_steps(trainer)
                per_step[name] = statistics.median(times[1:] or times)
            ratio = per_step["stock TRL"] / per_step["forkrl tree_packing"]
            log.info(
                "time per optimizer step (median, incl. generation): stock TRL %.2f s, tree_packing %.2f s -> %.2fx",
                per_step["stock TRL"],
                per_step["forkrl tree_packing"],
                ratio,
            )

        trainer = make_trainer(args, model_path, tmp / "train", True, args.steps, train_set)
        timed_steps(trainer)
        history = [h for h in trainer.state.log_history if "reward" in h]
        for h in history[:: max(1, len(history) // 8)]:
            log.info(
                "step %3d  reward %.3f  tree/compression %.1f  step_time %.2f s",
                h["step"],
                h["reward"],
                h["tree/compression"],
                h["step_time"],
            )
        first = statistics.mean(h["reward"] for h in history[:3])
        last = statistics.mean(h["reward"] for h in history[-3:])
        log.info("reward: first steps %.3f -> last steps %.3f", first, last)
        if args.summary:
            keys = ("step", "reward", "tree/compression", "step_time")
            summary = {
                "steps": [{k: h[k] for k in keys} for h in history],
                "first_reward": first,
                "last_reward": last,
            }
            with open(args.summary, "w") as f:
                json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
