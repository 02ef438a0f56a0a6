"""Whole TRL GRPO steps with TRL's colocated vLLM engine: stock, forkrl's tree, and the tree with
forkrl's self-drafter in the engine (``always`` and ``auto``), on a trained policy.

The policy is :mod:`benchmarks.speculative_rollout`'s (a SIZES Llama trained on the noisy
countdown; ``--load-model`` a state saved there with ``--save-model``, else trained here for
``--train-seconds``), saved as a Hugging Face folder in bf16 (the engine's dtype) with a word-level
tokenizer (``t<id>``, one word per token id). Each step trains ``--prompts`` countdown prompts of
the long-tailed workload (85% short completions, 15% long) with ``--num-generations`` completions
each, sampled at temperature 1 by TRL's engine, at ``--lr`` (small: the policy, and so the
drafter's acceptance, stays near the trained one). Each mode runs ``--steps`` optimizer steps in
its own process (vLLM 0.31 cannot start a second engine in a process), modes in turn for
``--rounds`` rounds; the first step of each process is a warm-up. Per step: the wall time, the part
in TRL's ``vllm_generation.generate`` (the rollout: the drafter's re-sync after each weight update
happens there, at the first draft), the part in its ``sync_weights``, and forkrl's ``spec/*`` logs.

    .venv-trl-vllm/bin/python -m benchmarks.trl_vllm_run --load-model /tmp/specrun/small300.pt
    .venv-trl-vllm/bin/python -m benchmarks.trl_vllm_run --model tiny --train-seconds 30 --steps 3   # quick look

Prints a table per mode (medians over steps and rounds) and a last line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import REPO, machine, print_table

MODES = ("stock", "tree", "always", "auto")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument(
        "--load-model", default="", help="a state saved by benchmarks.speculative_rollout --save-model"
    )
    ap.add_argument("--train-seconds", type=float, default=300)
    ap.add_argument(
        "--dir", default="/tmp/forkrl-trl-vllm-run", help="where the policy folder and results go"
    )
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument(
        "--steps", type=int, default=6, help="optimizer steps per process (the first is a warm-up)"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--always-k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def save_policy(args: argparse.Namespace) -> Path:
    """The trained policy as a Hugging Face folder (bf16) with a tokenizer of one word per token id."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from benchmarks import speculative_rollout as sr

    model = sr.make_model(args.model, "cpu", args.vocab)
    if args.load_model:
        model.load_state_dict(torch.load(args.load_model, map_location="cpu"))
        print(f"# loaded {args.model} from {args.load_model}", flush=True)
    else:
        print(f"# training {args.model} for {args.train_seconds:.0f} s", flush=True)
        losses = sr.train(model, args.train_seconds, 16, 48, "cpu", args.seed)
        print(f"# {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    folder = Path(args.dir) / "model"
    model.to(torch.bfloat16).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(args.vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=f"t{sr.PAD}", bos_token=f"t{sr.BOS}", eos_token=f"t{sr.EOS}"
    ).save_pretrained(folder)
    return folder


def reward(completions: list, **_) -> list[float]:
    """Completion length (any reward with a spread will do: this measures time, not learning)."""
    return [len(text.split()) / 100 for text in completions]


def child(args: argparse.Namespace) -> None:
    """One mode's run (this process): writes its per-step records to ``--out``."""
    os.environ["FORKRL_VLLM_DENSE_CPU"] = "1"  # every engine takes TRL's weight syncs on this CPU
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from benchmarks import speculative_rollout as sr

    mode = args.child
    g = torch.Generator().manual_seed(args.seed)
    v0s = sr.workload("longtail", args.prompts * args.steps, args.seed)
    data = Dataset.from_list([{"prompt": " ".join(f"t{t}" for t in sr.prompt(v, g))} for v in v0s])
    common = dict(
        output_dir=str(Path(args.out).parent / "trainer"), use_vllm=True, vllm_mode="colocate", use_cpu=True,
        bf16=False, model_init_kwargs={"dtype": torch.float32}, vllm_max_model_length=args.max_new_tokens + 32,
        max_steps=args.steps, num_generations=args.num_generations,
        per_device_train_batch_size=args.prompts * args.num_generations, max_completion_length=args.max_new_tokens,
        temperature=1.0, learning_rate=args.lr, logging_steps=1, report_to=[], seed=args.seed, shuffle_dataset=False,
    )  # fmt: skip
    if mode == "stock":
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(**common)
    else:
        from forkrl.plugins.trl import GRPOConfig, GRPOTrainer

        extra: dict = {"tree_packing": True}
        if mode in ("always", "auto"):
            extra.update(speculative_rollout=True, speculative_policy=mode)
            if mode == "always":
                extra["speculative_draft_len"] = args.always_k
        config = GRPOConfig(**common, **extra)
    folder = str(Path(args.dir) / "model")
    trainer = GRPOTrainer(model=folder, reward_funcs=reward, args=config, train_dataset=data)
    clock: dict[str, list[float]] = {"step": [], "generate": [], "sync": []}

    def timed(fn, key):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[key].append(time.perf_counter() - t0)

        return wrapped

    generation = trainer.vllm_generation
    generation.generate = timed(generation.generate, "generate")
    generation.sync_weights = timed(generation.sync_weights, "sync")

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()
            self.marks = (len(clock["generate"]), len(clock["sync"]))

        def on_step_end(self, *_, **__):
            clock["step"].append(time.perf_counter() - self.t0)
            for key, mark in zip(("generate", "sync"), self.marks, strict=True):
                clock[key][mark:] = [sum(clock[key][mark:])]  # one entry per step

    trainer.add_callback(StepClock())
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    steps = [
        {
            "step_s": clock["step"][i],
            "generate_s": clock["generate"][i],
            "sync_s": clock["sync"][i],
            "tokens": logs[i].get("completions/mean_length", 0.0) * args.prompts * args.num_generations,
            **{k: v for k, v in logs[i].items() if k.startswith("spec/")},
        }  # fmt: skip
        for i in range(len(clock["step"]))
    ]
    Path(args.out).write_text(json.dumps({"mode": mode, "steps": steps}))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    save_policy(args)
    modes = [m for m in args.modes.split(",") if m]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            out = Path(args.dir) / f"{mode}_{r}.json"
            cmd = [sys.executable, "-m", "benchmarks.trl_vllm_run", *(argv or sys.argv[1:])]
            proc = subprocess.run(
                [*cmd, "--child", mode, "--out", str(out)], cwd=REPO, capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise SystemExit(f"{mode}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
            runs[mode] += json.loads(out.read_text())["steps"][1:]  # the first step warms up
            print(f"# round {r} {mode}: {[round(s['step_s'], 2) for s in runs[mode]]} s per step", flush=True)
    rows = []
    for mode in modes:
        steps = runs[mode]
        row = {"mode": mode, "steps": len(steps)}
        for key in ("step_s", "generate_s", "sync_s", "tokens", "spec/acceptance", "spec/draft_len"):
            values = [s[key] for s in steps if key in s]
            if values:
                row[key] = statistics.median(values)
        row["rollout_share"] = row["generate_s"] / row["step_s"]
        row["tok_per_rollout_s"] = row["tokens"] / row["generate_s"]
        rows.append(row)
    base = next((r for r in rows if r["mode"] == "stock"), rows[0])
    for row in rows:
        row["step_speedup"] = base["step_s"] / row["step_s"]
        row["rollout_speedup"] = row["tok_per_rollout_s"] / base["tok_per_rollout_s"]
    print_table(
        rows,
        [
            ("mode", "{}"), ("steps", "{}"), ("step_s", "{:.2f}"), ("generate_s", "{:.2f}"), ("sync_s", "{:.2f}"),
            ("rollout_share", "{:.2f}"), ("tokens", "{:.0f}"), ("tok_per_rollout_s", "{:.0f}"),
            ("rollout_speedup", "{:.2f}"), ("step_speedup", "{:.2f}"), ("spec/acceptance", "{:.3f}"),
            ("spec/draft_len", "{:.2f}"),
        ],
    )  # fmt: skip
    from importlib.metadata import version

    info = {**machine(), "trl": version("trl"), "vllm": version("vllm-cpu")}
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "out")}
    print(json.dumps({"machine": info, "args": settings, "rows": rows}))


if __name__ == "__main__":
    main()
