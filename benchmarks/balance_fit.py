"""The balancer's cost model fitted to measured tree-step timings on this machine, checked on held-out shapes.

Each shape is one GRPO step (``groups`` prompts of P tokens, G responses of R tokens, random tokens)
trained by :class:`forkrl.core.train.TreeStep` (keep mode, the general loss path: a scoring pass,
then one backward), timed as the median of ``--reps`` runs after a warm-up. Its
:class:`~forkrl.core.balance.PieceStats` (unique tokens, attended query-key pairs, units) come from
the step's forest. :meth:`CostModel.fit` is fitted on every other shape and predicts the rest.

    .venv/bin/python -m benchmarks.balance_fit                 # tiny Llama, 12 shapes
    .venv/bin/python -m benchmarks.balance_fit --model micro --reps 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from benchmarks.common import machine, print_table
from forkrl.core import PrefixForest, RowLayout, TreeOptions, TreeStep
from forkrl.core.balance import CostModel, PieceStats, trees_of_forest
from forkrl.core.testing.models import SIZES, llama
from forkrl.core.train import StepLoss

SHAPES = [  # (groups, P, G, R)
    (1, 64, 2, 16),
    (1, 64, 8, 64),
    (1, 256, 4, 16),
    (1, 256, 8, 256),
    (1, 1024, 2, 64),
    (1, 1024, 8, 16),
    (2, 64, 4, 256),
    (2, 256, 2, 64),
    (2, 1024, 4, 64),
    (4, 64, 8, 16),
    (4, 256, 4, 64),
    (1, 2048, 4, 128),
]


def rows(shape, vocab: int, seed: int):
    groups, P, G, R = shape
    rng = random.Random(seed)
    seqs, score_from = [], []
    for _ in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(P)]
        for _ in range(G):
            seqs.append(prompt + [rng.randrange(vocab) for _ in range(R)])
            score_from.append(P)
    return seqs, score_from


def measure(model, shape, vocab: int, reps: int) -> tuple[PieceStats, float]:
    seqs, score_from = rows(shape, vocab, seed=hash(shape) % 1000)
    stats = sum((t.stats() for t in trees_of_forest(PrefixForest.build(seqs, score_from))), PieceStats())
    layout = RowLayout.spans([torch.tensor(s) for s in seqs], score_from)
    step = TreeStep(TreeOptions(tree_packing=True, tree_mode="keep"))

    def loss_fn(i, lp, ent):
        return -(lp * layout.mask(lp.device)).sum() / layout.num_scored

    times = []
    for rep in range(reps + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step.train(model, [layout], StepLoss(loss_fn, entropy=False))
        if rep:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return stats, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=list(SIZES))
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    vocab = SIZES[args.model][5]
    model = llama(args.model)
    model.train()
    measured = [measure(model, shape, vocab, args.reps) for shape in SHAPES]
    fit = CostModel.fit([s for s, _ in measured[::2]], [t for _, t in measured[::2]])
    table = []
    for k, (shape, (stats, seconds)) in enumerate(zip(SHAPES, measured, strict=True)):
        predicted = fit.predict(stats)
        table.append(
            {
                "shape": "groups={} P={} G={} R={}".format(*shape),
                "set": "fit" if k % 2 == 0 else "held-out",
                "tokens": int(stats.tokens),
                "units": int(stats.units),
                "measured_s": seconds,
                "predicted_s": predicted,
                "error": predicted / seconds - 1,
            }
        )
    print(f"CostModel fitted to TreeStep timings: model={args.model}, median of {args.reps} after a warm-up")
    print_table(
        table,
        [
            ("shape", "{}"),
            ("set", "{}"),
            ("tokens", "{}"),
            ("units", "{}"),
            ("measured_s", "{:.3f}"),
            ("predicted_s", "{:.3f}"),
            ("error", "{:+.1%}"),
        ],
    )
    held = [abs(r["error"]) for r in table if r["set"] == "held-out"]
    print(f"fit: {fit}; held-out |error| median {statistics.median(held):.1%}, max {max(held):.1%}")
    print(
        json.dumps(
            {
                "benchmark": "balance_fit",
                "model": args.model,
                "fit": vars(fit),
                "held_out_abs_error_median": statistics.median(held),
                "held_out_abs_error_max": max(held),
                "rows": table,
                "machine": machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
