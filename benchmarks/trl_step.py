"""TRL GRPO training phase per optimizer step: stock ``trl.GRPOTrainer`` vs forkrl's ``tree_packing=True``.

Long-prompt GRPO: each optimizer step trains ``--groups`` prompts of P tokens with G completions of R
tokens (fixed rollouts from a ``rollout_func``, so generation costs nothing and both trainers see
the same data). Both trainers are built in this process from the same weights and run one
optimizer step's worth of TRL ``training_step`` calls (gradient-accumulation micro-batches:
rollout, rewards, advantages, forward, backward) on the same prompts, alternating stock and tree
step by step so that machine-load drift hits both alike. Reported: the median seconds per
optimizer step after one warm-up, and how far the tree's gradient is from stock TRL's.

    .venv/bin/python -m benchmarks.trl_step                      # small model, P=2048, G=8, R=256
    .venv/bin/python -m benchmarks.trl_step --model tiny --P 512 --steps 2
    .venv/bin/python -m benchmarks.trl_step --gradient-checkpointing   # both with TRL's default checkpointing
    .venv/bin/python -m benchmarks.trl_step --bf16               # TRL's default bf16=True (autocast)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine, print_table
from forkrl.core.testing.models import SIZES, llama, word_tokenizer

# SIZES' "micro" is prefix_grouper_compare's smoke-test size; the choices here stay tiny and small.
MODEL_CHOICES = [name for name in SIZES if name != "micro"]


def rollouts(P: int, R: int, vocab: int, eos: int):
    def rollout_func(prompts, trainer):
        seen: dict[str, int] = {}
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": None}
        for p in prompts:
            k = seen.get(p, 0)
            seen[p] = k + 1
            rp = random.Random(f"prompt-{p}")
            rc = random.Random(f"completion-{p}-{k}")
            out["prompt_ids"].append([rp.randrange(vocab - 2) for _ in range(P)])
            out["completion_ids"].append([rc.randrange(vocab - 2) for _ in range(R - 1)] + [eos])
        return out

    return rollout_func


def reward(completion_ids, **kwargs):
    return [sum(1 for t in ids if t % 7 == 0) / len(ids) for ids in completion_ids]


def make_trainer(method: str, args, model_dir: str, tok, out: Path):
    import trl
    from datasets import Dataset

    from forkrl.plugins import trl as ftrl

    vocab = SIZES[args.model][5]
    common = dict(
        output_dir=str(out / method),
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=args.micro_batch,
        num_generations=args.G,
        gradient_accumulation_steps=args.G * args.groups // args.micro_batch,
        max_completion_length=args.R,
        seed=0,
        gradient_checkpointing=args.gradient_checkpointing,
        disable_dropout=True,
    )
    if method == "stock":
        config, cls = trl.GRPOConfig(**common), trl.GRPOTrainer
    else:
        config, cls = ftrl.GRPOConfig(**common, tree_packing=True), ftrl.GRPOTrainer
    return cls(
        model=model_dir,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [f"t{i}" for i in range(args.groups)]}),
        processing_class=tok,
        rollout_func=rollouts(args.P, args.R, vocab, vocab - 1),
    )


def optimizer_step_work(trainer, batch) -> tuple[float, dict[str, torch.Tensor]]:
    """One optimizer step's worth of TRL training steps (rollout, rewards, forward, backward) on the
    same prompts, as the Trainer's inner loop runs them; returns (seconds, gradients)."""
    model = trainer.model_wrapped
    model.zero_grad(set_to_none=True)
    gas = trainer.args.gradient_accumulation_steps
    trainer.current_gradient_accumulation_steps = gas
    state = trainer.accelerator.gradient_state
    t0 = time.perf_counter()
    for i in range(gas):
        state._set_sync_gradients(i == gas - 1)
        trainer.training_step(model, batch, None)
    seconds = time.perf_counter() - t0
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return seconds, grads


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=MODEL_CHOICES)
    ap.add_argument("--P", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--G", type=int, default=8, help="completions per prompt")
    ap.add_argument("--R", type=int, default=256, help="completion tokens")
    ap.add_argument("--groups", type=int, default=1, help="prompts per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=4, help="per_device_train_batch_size")
    ap.add_argument("--steps", type=int, default=3, help="measured optimizer steps (after one warm-up)")
    ap.add_argument(
        "--gradient-checkpointing", action="store_true", help="TRL's default; off by default here"
    )
    ap.add_argument(
        "--bf16", action="store_true", help="TRL's default bf16=True (autocast); float32 otherwise"
    )
    ap.add_argument("--methods", default="stock,tree")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if (args.G * args.groups) % args.micro_batch:
        ap.error("G * groups must be a multiple of --micro-batch")
    return args


def run(args, tok, methods: list[str]):
    """Build every trainer from the same saved weights and time ``--steps`` optimizer steps each
    (after one warm-up), methods alternating. Returns (seconds per method, last gradients per
    method, the tree's compression or None)."""
    times: dict[str, list[float]] = {m: [] for m in methods}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    compression = None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        model = llama(args.model, max_pos=max(4096, args.P + args.R))
        for cfg in (model.config, model.generation_config):
            cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
        model.save_pretrained(out / "model")
        tok.save_pretrained(out / "model")
        del model
        trainers = {m: make_trainer(m, args, str(out / "model"), tok, out) for m in methods}
        batch = next(iter(trainers[methods[0]].get_train_dataloader()))
        # Alternate the methods step by step so that drifting machine load hits both alike.
        for rep in range(args.steps + 1):
            for m in methods:
                seconds, g = optimizer_step_work(trainers[m], batch)
                print(f"  step {rep} {m}: {seconds:.2f} s", file=sys.stderr, flush=True)
                if rep > 0:  # the first is a warm-up
                    times[m].append(seconds)
                grads[m] = g
        if "tree" in trainers:
            compression = trainers["tree"]._metrics["train"]["tree/compression"][-1]
    return times, grads, compression


def summarize(methods: list[str], times, grads, compression):
    """Table rows per method, and (speedup of tree over stock, gradient agreement), None without both."""
    rows = []
    for m in methods:
        rows.append(
            {
                "method": m,
                "step_s": statistics.median(times[m]),
                "steps": " ".join(f"{t:.1f}" for t in times[m]),
            }
        )
    speedup = agreement = None
    if "stock" in times and "tree" in times:
        speedup = statistics.median(times["stock"]) / statistics.median(times["tree"])
        norm = max(g.abs().max().item() for g in grads["stock"].values())
        agreement = (
            max((grads["stock"][n] - grads["tree"][n]).abs().max().item() for n in grads["stock"]) / norm
        )
        for r in rows:
            r["speedup"] = statistics.median(times["stock"]) / r["step_s"]
            if r["method"] == "tree":
                r["compression"] = compression
    return rows, speedup, agreement


def report(args, rows, times, speedup, agreement) -> None:
    print(
        f"TRL GRPO training phase per optimizer step: model={args.model} P={args.P} G={args.G} R={args.R} "
        f"groups/step={args.groups} micro-batch={args.micro_batch} gradient_checkpointing={args.gradient_checkpointing} "
        f"bf16={args.bf16}"
    )
    print_table(
        rows,
        [
            ("method", "{}"),
            ("step_s", "{:.2f}"),
            ("speedup", "{:.2f}"),
            ("compression", "{:.2f}"),
            ("steps", "{}"),
        ],
    )
    if agreement is not None:
        print(f"gradients: max |tree - stock| / max |stock| = {agreement:.2e}")
    print(
        json.dumps(
            {
                "benchmark": "trl_step",
                "model": args.model,
                "P": args.P,
                "G": args.G,
                "R": args.R,
                "groups": args.groups,
                "micro_batch": args.micro_batch,
                "gradient_checkpointing": args.gradient_checkpointing,
                "bf16": args.bf16,
                "step_s": {m: statistics.median(times[m]) for m in times},
                "speedup": speedup,
                "grad_agreement": agreement,
                "machine": machine(),
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


def main() -> None:
    args = parse_args()
    tok = word_tokenizer(SIZES[args.model][5])
    methods = args.methods.split(",")
    times, grads, compression = run(args, tok, methods)
    rows, speedup, agreement = summarize(methods, times, grads, compression)
    report(args, rows, times, speedup, agreement)


if __name__ == "__main__":
    main()
