"""veRL actor update per optimizer step: veRL's FSDP2 engine vs forkrl's ``fsdp2_tree`` engine (CPU).

Long-prompt GRPO: each optimizer step (one ``update_actor`` mini-batch) trains ``--groups`` prompts
of P tokens with G responses of R tokens (fixed random rollouts, so both engines see identical
data). Both engines are built in this process by veRL's real ``TrainingWorker`` from the same
weights (float32, SGD with a large step, so that the parameter comparison sees the update above
float32 rounding) and alternate step by step, so that machine-load drift hits both alike; the
old-log-prob pass (``compute_log_prob``) is timed the same way. Reported: median seconds after one
warm-up, and how far the tree engine's parameters are from stock's after the run (relative to
stock's change). veRL has no CPU platform: forkrl's test support sets one up
(:func:`forkrl.plugins.verl.testing.start`).

    .venv-verl/bin/python -m benchmarks.verl_step                  # small model, P=2048, G=8, R=256
    .venv-verl/bin/python -m benchmarks.verl_step --model tiny --P 256 --R 32 --steps 1
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

from benchmarks.common import machine, print_table
from forkrl.core.testing.models import SIZES, llama, save_pretrained, word_tokenizer
from forkrl.core.testing.stock import relative_difference, update_size
from forkrl.plugins.verl import testing as h

MODEL_CHOICES = [s for s in SIZES if s != "micro"]
LR = 20.0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=MODEL_CHOICES)
    ap.add_argument("--P", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--G", type=int, default=8, help="responses per prompt")
    ap.add_argument("--R", type=int, default=256, help="response tokens")
    ap.add_argument("--groups", type=int, default=1, help="prompts per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=4, help="ppo_micro_batch_size_per_gpu")
    ap.add_argument("--steps", type=int, default=2, help="measured optimizer steps (after one warm-up)")
    ap.add_argument("--no-remove-padding", dest="remove_padding", action="store_false")
    return ap.parse_args()


def rollouts(args, vocab: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for g in range(args.groups):
        rp = random.Random(f"prompt-{g}")
        prompt = [rp.randrange(vocab - 2) for _ in range(args.P)]
        for k in range(args.G):
            rc = random.Random(f"response-{g}-{k}")
            out.append((prompt, [rc.randrange(vocab - 2) for _ in range(args.R)]))
    return out


def run(args) -> tuple[dict, dict, float, float]:
    vocab = SIZES[args.model][5]
    rows = rollouts(args, vocab)
    mini = args.G * args.groups
    with tempfile.TemporaryDirectory() as tmp:
        tok = word_tokenizer(vocab)
        model = llama(args.model, max_pos=max(4096, args.P + args.R))
        for cfg in (model.config, model.generation_config):
            cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
        path = save_pretrained(model, tok, Path(tmp) / "model")
        del model
        actor = dict(ppo_mini_batch_size=mini, ppo_micro_batch_size_per_gpu=args.micro_batch)
        # SGD with a large step: the update must stand well above float32 rounding of the weights
        # for the parameter comparison to see the gradient (the step size does not change the timing).
        workers = {
            "stock": h.worker(path, h.actor_config(None, **actor), args.remove_padding, lr=LR),
            "tree": h.worker(
                path, h.actor_config({"tree_packing": True}, **actor), args.remove_padding, lr=LR
            ),
        }
        init = h.parameters(workers["stock"])
        times = {m: {"update": [], "log_prob": []} for m in workers}
        compression = None
        for rep in range(args.steps + 1):
            td = h.batch(rows, seed=rep)
            for m, w in workers.items():
                t0 = time.perf_counter()
                h.log_probs(w, td, entropy=True)
                t1 = time.perf_counter()
                metrics = h.update(w, td, mini, entropy=False)
                t2 = time.perf_counter()
                print(
                    f"  step {rep} {m}: log_prob {t1 - t0:.2f} s, update {t2 - t1:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
                if rep > 0:  # the first is a warm-up
                    times[m]["log_prob"].append(t1 - t0)
                    times[m]["update"].append(t2 - t1)
                if m == "tree":
                    compression = metrics["tree/compression"][0]
        stock, tree = h.parameters(workers["stock"]), h.parameters(workers["tree"])
        change, agreement = update_size(stock, init), relative_difference(stock, tree, init)
    return times, {"compression": compression}, agreement, change


def report(args, times, extra, agreement) -> None:
    med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
    rows = []
    for m in times:
        rows.append(
            {
                "method": m,
                "update_s": med[m]["update"],
                "update_speedup": med["stock"]["update"] / med[m]["update"],
                "log_prob_s": med[m]["log_prob"],
                "log_prob_speedup": med["stock"]["log_prob"] / med[m]["log_prob"],
                "steps": " ".join(f"{t:.1f}" for t in times[m]["update"]),
                **({"compression": extra["compression"]} if m == "tree" else {}),
            }
        )
    print(
        f"veRL actor update per optimizer step: model={args.model} P={args.P} G={args.G} R={args.R} "
        f"groups/step={args.groups} micro-batch={args.micro_batch} remove_padding={args.remove_padding}"
    )
    print_table(
        rows,
        [
            ("method", "{}"),
            ("update_s", "{:.2f}"),
            ("update_speedup", "{:.2f}"),
            ("log_prob_s", "{:.2f}"),
            ("log_prob_speedup", "{:.2f}"),
            ("compression", "{:.2f}"),
            ("steps", "{}"),
        ],
    )
    print(f"parameters after the run: max |tree - stock| / max |stock - initial| = {agreement:.2e}")
    print(
        json.dumps(
            {
                "benchmark": "verl_step",
                "model": args.model,
                "P": args.P,
                "G": args.G,
                "R": args.R,
                "groups": args.groups,
                "micro_batch": args.micro_batch,
                "remove_padding": args.remove_padding,
                "update_s": {m: med[m]["update"] for m in med},
                "log_prob_s": {m: med[m]["log_prob"] for m in med},
                "update_speedup": med["stock"]["update"] / med["tree"]["update"],
                "log_prob_speedup": med["stock"]["log_prob"] / med["tree"]["log_prob"],
                "param_agreement": agreement,
                "machine": machine(),
            }
        )
    )


def main() -> None:
    args = parse_args()
    h.start()
    times, extra, agreement, _ = run(args)
    report(args, times, extra, agreement)


if __name__ == "__main__":
    main()
