"""OpenRLHF actor training per optimizer step: OpenRLHF's ActorPPOTrainer vs forkrl's (CPU).

Long-prompt GRPO: each optimizer step (``--train.batch_size`` rows, ``accumulated_gradient``
micro-batches of ``--train.micro_batch_size``) trains ``--groups`` prompts of P tokens with G
responses of R tokens (fixed random rollouts, so both trainers see identical data). Both
trainers are OpenRLHF's real ``ActorPPOTrainer`` (stock, and forkrl's subclass) around a real
DeepSpeed ZeRO-2 engine, fed through OpenRLHF's replay buffer and ``ppo_train``, built in this
process from the same weights (float32, SGD with a large step, so that the parameter comparison sees
the update above float32 rounding) and alternated step by step, so that machine-load drift hits both
alike. The old-log-prob pass (``PolicyModelActor.forward``: OpenRLHF's ``Actor`` under no_grad, one
call per rollout micro-batch of G rows, vs forkrl's tree scorer) is timed the same way. Reported:
median seconds after one warm-up, and how far forkrl's parameters are from stock's after the run
(relative to stock's change). OpenRLHF assumes CUDA: forkrl's test support points it at the CPU
(:func:`forkrl.plugins.openrlhf.testing.cpu`).

    .venv-openrlhf/bin/python -m benchmarks.openrlhf_step                # small model, P=2048, G=8, R=256
    .venv-openrlhf/bin/python -m benchmarks.openrlhf_step --model tiny --P 256 --R 32 --steps 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from benchmarks.common import machine, print_table
from forkrl.core.testing.models import SIZES, llama
from forkrl.core.testing.stock import relative_difference
from forkrl.plugins.openrlhf import testing as h
from forkrl.plugins.openrlhf.trainer import score_log_probs, tree_module

MODEL_CHOICES = [s for s in SIZES if s != "micro"]
LR = 20.0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=MODEL_CHOICES)
    ap.add_argument("--P", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--G", type=int, default=8, help="responses per prompt")
    ap.add_argument("--R", type=int, default=256, help="response tokens")
    ap.add_argument("--groups", type=int, default=1, help="prompts per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=2, help="--train.micro_batch_size")
    ap.add_argument("--steps", type=int, default=2, help="measured optimizer steps (after one warm-up)")
    ap.add_argument("--packing", action="store_true", help="--ds.packing_samples for stock OpenRLHF")
    return ap.parse_args()


def experience(args, vocab: int, step: int):
    """One optimizer step's rollouts as an OpenRLHF experience."""
    rows = []
    for g in range(args.groups):
        rp = random.Random(f"prompt-{step}-{g}")
        prompt = [rp.randrange(vocab - 2) for _ in range(args.P)]
        for k in range(args.G):
            rc = random.Random(f"response-{step}-{g}-{k}")
            rows.append((prompt, [rc.randrange(vocab - 2) for _ in range(args.R)]))
    return h.experience(rows, seed=step, kl=False)


def run(args) -> tuple[dict, dict, float]:
    vocab = SIZES[args.model][5]
    rows = args.G * args.groups
    extra = ["--ds.packing_samples"] if args.packing else []
    argv = h.command("unused", *extra, "--forkrl.tree_packing", micro_batch=args.micro_batch, batch=rows)
    argv[argv.index("--rollout.n_samples_per_prompt") + 1] = str(args.G)
    argv[argv.index("--rollout.micro_batch_size") + 1] = str(args.G)
    ppo_args = h.parse_args(argv)
    trainers = {
        "stock": h.trainer(
            ppo_args, forkrl=False, lr=LR, model=llama(args.model, max_pos=max(4096, args.P + args.R))
        ),
        "tree": h.trainer(
            ppo_args, forkrl=True, lr=LR, model=llama(args.model, max_pos=max(4096, args.P + args.R))
        ),
    }
    init = h.parameters(trainers["stock"])
    times = {m: {"update": [], "log_prob": []} for m in trainers}
    compression = None
    for rep in range(args.steps + 1):
        e = experience(args, vocab, rep)
        for m, t in trainers.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                for lo in range(0, rows, args.G):  # one call per rollout micro-batch, as OpenRLHF makes them
                    seq, act, att = (
                        x[lo : lo + args.G] for x in (e.sequences, e.action_mask, e.attention_mask)
                    )
                    if m == "stock":
                        t.actor.eval()
                        t.actor(seq, act, att)
                    else:
                        score_log_probs(t.tree_step, tree_module(t.actor), seq, act, att)
            t1 = time.perf_counter()
            h.fill(t, [e])
            torch.manual_seed(rep)
            with h.cpu():
                status = t.ppo_train(0.0)
            t.replay_buffer.clear()
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
                compression = status["tree/compression"]
    stock, tree = h.parameters(trainers["stock"]), h.parameters(trainers["tree"])
    agreement = relative_difference(stock, tree, init)
    return times, {"compression": compression}, agreement


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
        f"OpenRLHF actor training per optimizer step: model={args.model} P={args.P} G={args.G} R={args.R} "
        f"groups/step={args.groups} micro-batch={args.micro_batch} packing={args.packing} (DeepSpeed ZeRO-2)"
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
                "benchmark": "openrlhf_step",
                "model": args.model,
                "P": args.P,
                "G": args.G,
                "R": args.R,
                "groups": args.groups,
                "micro_batch": args.micro_batch,
                "packing": args.packing,
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
    times, extra, agreement = run(args)
    report(args, times, extra, agreement)


if __name__ == "__main__":
    main()
