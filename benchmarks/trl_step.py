"""TRL GRPO training phase per optimizer step: stock ``trl.GRPOTrainer`` vs forkrl's ``tree_packing=True``.

Long-prompt GRPO: each optimizer step trains ``--groups`` prompts of P tokens with G completions of R
tokens (fixed rollouts from a ``rollout_func``, so generation costs nothing and both trainers see
the same data). Both trainers run in this process, one after the other, from the same weights;
the time per optimizer step (median over the measured steps, after one warm-up step) covers
everything TRL does in the step but generation: rewards, advantages, forward, backward, optimizer.
The final parameters of the two runs are compared (SGD, so the update is linear in the gradient).

    .venv/bin/python benchmarks/trl_step.py                      # small model, P=2048, G=8, R=256
    .venv/bin/python benchmarks/trl_step.py --model tiny --P 512 --steps 2
    .venv/bin/python benchmarks/trl_step.py --gradient-checkpointing   # both with TRL's default checkpointing
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, machine, make_llama, print_table  # noqa: E402


def word_tokenizer(vocab: int):
    """A word-level tokenizer over ids ``t0..t{vocab-3}`` plus <pad> and <eos> (decoding only)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {f"t{i}": i for i in range(vocab - 2)}
    table["<pad>"], table["<eos>"] = vocab - 2, vocab - 1
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


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


def run(method: str, args, model_dir: str, tok, out: Path) -> tuple[list[float], dict, dict]:
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from forkrl.plugins import trl as ftrl

    vocab = MODELS[args.model][5]
    common = dict(
        output_dir=str(out / method),
        use_cpu=args.device == "cpu",
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        max_steps=args.steps + 1,
        per_device_train_batch_size=args.micro_batch,
        num_generations=args.G,
        gradient_accumulation_steps=args.G * args.groups // args.micro_batch,
        max_completion_length=args.R,
        learning_rate=1e-2,
        optim="sgd",
        lr_scheduler_type="constant",
        seed=0,
        gradient_checkpointing=args.gradient_checkpointing,
        disable_dropout=True,
    )
    if method == "stock":
        config, cls = trl.GRPOConfig(**common), trl.GRPOTrainer
    else:
        config, cls = ftrl.GRPOConfig(**common, tree_packing=True), ftrl.GRPOTrainer

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

    n_prompts = args.groups * (args.steps + 1)
    trainer = cls(
        model=model_dir,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [f"t{i}" for i in range(n_prompts)]}),
        processing_class=tok,
        rollout_func=rollouts(args.P, args.R, vocab, vocab - 1),
        callbacks=[StepTimer()],
    )
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return times[1:], params, logs[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=list(MODELS))
    ap.add_argument("--P", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--G", type=int, default=8, help="completions per prompt")
    ap.add_argument("--R", type=int, default=256, help="completion tokens")
    ap.add_argument("--groups", type=int, default=1, help="prompts per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=4, help="per_device_train_batch_size")
    ap.add_argument("--steps", type=int, default=3, help="measured optimizer steps (after one warm-up)")
    ap.add_argument(
        "--gradient-checkpointing", action="store_true", help="TRL's default; off by default here"
    )
    ap.add_argument("--methods", default="stock,tree")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if (args.G * args.groups) % args.micro_batch:
        ap.error("G * groups must be a multiple of --micro-batch")

    tok = word_tokenizer(MODELS[args.model][5])
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        model = make_llama(args.model, max_pos=max(4096, args.P + args.R))
        model.config.pad_token_id = tok.pad_token_id
        model.config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(out / "model")
        tok.save_pretrained(out / "model")
        del model
        for method in args.methods.split(","):
            times, params, last = run(method, args, str(out / "model"), tok, out)
            results[method] = (statistics.median(times), params, last)
            rows.append(
                {
                    "method": method,
                    "step_s": statistics.median(times),
                    "steps": " ".join(f"{t:.1f}" for t in times),
                    "loss": last["loss"],
                }
            )
            if "tree/compression" in last:
                rows[-1]["compression"] = last["tree/compression"]
    speedup = agreement = None
    if "stock" in results and "tree" in results:
        speedup = results["stock"][0] / results["tree"][0]
        stock_p, tree_p = results["stock"][1], results["tree"][1]
        init = make_llama(args.model, max_pos=max(4096, args.P + args.R)).state_dict()
        change = max((stock_p[n] - init[n]).abs().max().item() for n in stock_p)
        diff = max((stock_p[n] - tree_p[n]).abs().max().item() for n in stock_p)
        agreement = diff / change
        for r in rows:
            r["speedup"] = results["stock"][0] / r["step_s"]
    print(
        f"TRL GRPO training phase per optimizer step: model={args.model} P={args.P} G={args.G} R={args.R} "
        f"groups/step={args.groups} micro-batch={args.micro_batch} gradient_checkpointing={args.gradient_checkpointing}"
    )
    print_table(
        rows,
        [
            ("method", "{}"),
            ("step_s", "{:.2f}"),
            ("speedup", "{:.2f}"),
            ("compression", "{:.2f}"),
            ("loss", "{:.5f}"),
            ("steps", "{}"),
        ],
    )
    if agreement is not None:
        print(f"final parameters: max |tree - stock| / max |stock - init| = {agreement:.2e}")
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
                "step_s": {m: results[m][0] for m in results},
                "speedup": speedup,
                "param_agreement": agreement,
                "machine": machine(),
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
