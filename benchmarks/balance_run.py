"""The balancer on real ranks: a skewed step on 2 gloo processes, with and without forkrl.core.balance.

One step's rows: ``--long`` GRPO groups with prompts of ``--P-long`` tokens and ``--short`` groups
with prompts of ``--P-short``, every group ``--G`` responses of ``--R`` tokens. Unbalanced, the rows
are split over the ranks in their order, as a host that balances nothing (or counts rows) does:
rank 0 gets the long-prompt groups, rank 1 the short ones (equal row counts). Balanced, every rank
runs :func:`forkrl.core.balance.balance` on the step's trees (equal rows per rank, the default
token cost model) and trains the rows the plan gives it. Each rank trains its rows with
:class:`forkrl.core.train.TreeStep` (keep mode, data-parallel gradient average), its loss a
token-mean over the whole step (normalised by the global count, so the update does not depend on
the assignment: checked, parameters' gradients of the two runs compared). Step time = wall time of
the slowest rank from a barrier to the averaged gradient (beside it, each rank's own tree
scoring + backward time: a rank that finishes early waits in the all-reduce); median of ``--reps``, the two runs
alternating. Prints a table, then one line of JSON.

    .venv/bin/python -m benchmarks.balance_run                      # tiny Llama, about a minute
    .venv/bin/python -m benchmarks.balance_run --model micro --reps 1 --P-long 256 --P-short 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time


def step_rows(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The step's sequences (long-prompt groups first) and where their scored spans start."""
    rng = random.Random(0)
    seqs, score_from = [], []
    for P in [args.P_long] * args.long + [args.P_short] * args.short:
        prompt = [rng.randrange(vocab) for _ in range(P)]
        for _ in range(args.G):
            seqs.append(prompt + [rng.randrange(vocab) for _ in range(args.R)])
            score_from.append(P)
    return seqs, score_from


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from forkrl.core import PrefixForest, RowLayout, TreeOptions, TreeStep
    from forkrl.core.balance import balance, evaluate, trees_of_forest
    from forkrl.core.testing.models import llama
    from forkrl.core.testing.ranks import finish, report
    from forkrl.core.train import ParallelContext, StepLoss

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = llama(args.model)
    model.train()
    seqs, score_from = step_rows(args, model.config.vocab_size)
    n = len(seqs)
    total_scored = sum(len(s) - f for s, f in zip(seqs, score_from, strict=True))
    g = torch.Generator().manual_seed(1)
    coefs = [torch.randn(len(s) - f, generator=g) for s, f in zip(seqs, score_from, strict=True)]
    per_rank = n // world
    unbalanced = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(world)]
    t0 = time.perf_counter()
    trees = trees_of_forest(PrefixForest.build(seqs, score_from))
    plan = balance(trees, world, rows_per_rank=per_rank)
    plan_seconds = time.perf_counter() - t0
    before = evaluate(trees, unbalanced)
    step = TreeStep(TreeOptions(tree_packing=True, tree_mode="keep"))

    def run(ids: list[int]) -> tuple[float, float, list]:
        layout = RowLayout.spans([torch.tensor(seqs[i]) for i in ids], [score_from[i] for i in ids])
        host_coef = layout.to_host(torch.cat([coefs[i] for i in ids]))

        def loss_fn(i, lp, ent):  # a token-mean over the whole step: the same whatever the assignment
            return (lp * host_coef).sum() / total_scored

        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        res = step.train(
            model, [layout], StepLoss(loss_fn, entropy=False), ParallelContext(average_gradients=True)
        )
        own = time.perf_counter() - start
        wall = torch.tensor([own], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        compute = res.metrics.backward_time + res.metrics.score_time  # this rank's, before it waits
        return float(wall), compute, [p.grad.detach().clone() for p in model.parameters()]

    run(plan.ranks[rank][:2])  # warm-up
    times = {"unbalanced": [], "balanced": []}
    own = {"unbalanced": [], "balanced": []}
    grads = {}
    for _ in range(args.reps):
        for name, ranks in (("unbalanced", unbalanced), ("balanced", plan.ranks)):
            wall, mine, grads[name] = run(ranks[rank])
            times[name].append(wall)
            own[name].append(mine)
    diff = max(float((a - b).norm()) for a, b in zip(grads["balanced"], grads["unbalanced"], strict=True))
    scale = max(float(b.norm()) for b in grads["unbalanced"])
    out = {
        "rank": rank,
        "rows_unbalanced": unbalanced[rank],
        "rows_balanced": sorted(plan.ranks[rank]),
        "unbalanced_s": statistics.median(times["unbalanced"]),
        "balanced_s": statistics.median(times["balanced"]),
        "own_unbalanced_s": statistics.median(own["unbalanced"]),
        "own_balanced_s": statistics.median(own["balanced"]),
        "predicted_unbalanced": before.costs,
        "predicted_balanced": plan.costs,
        "lower_bound": plan.lower_bound,
        "plan_seconds": plan_seconds,
        "grad_agreement": diff / scale,
    }
    report("RESULT " + json.dumps(out))
    finish()


def launch(args) -> None:
    """Start ``--ranks`` ranks of this script (torchrun) and print their joint table and JSON."""
    from benchmarks.common import machine, print_table, run_ranks

    results = run_ranks("benchmarks.balance_run", "FORKRL_BALANCE_RUN_RANK", ranks=args.ranks)
    r0 = results[0]
    rows = [
        {
            "assignment": name,
            "rows per rank": " / ".join(str(len(r[f"rows_{name}"])) for r in results),
            "predicted cost per rank": " / ".join(f"{c:.0f}" for c in r0[f"predicted_{name}"]),
            "measured s per rank": " / ".join(f"{r[f'own_{name}_s']:.2f}" for r in results),
            "makespan / bound": max(r0[f"predicted_{name}"]) / r0["lower_bound"],
            "step s": r0[f"{name}_s"],
        }
        for name in ("unbalanced", "balanced")
    ]
    speedup = r0["unbalanced_s"] / r0["balanced_s"]
    print(
        f"Skewed step on {args.ranks} gloo ranks: model={args.model}, {args.long} groups P={args.P_long} + "
        f"{args.short} groups P={args.P_short}, G={args.G}, R={args.R}; median of {args.reps}"
    )
    print_table(
        rows,
        [
            ("assignment", "{}"),
            ("rows per rank", "{}"),
            ("predicted cost per rank", "{}"),
            ("measured s per rank", "{}"),
            ("makespan / bound", "{:.2f}"),
            ("step s", "{:.2f}"),
        ],
    )
    agreement = max(r["grad_agreement"] for r in results)
    print(
        f"balanced step {speedup:.2f}x faster; balancer {1e3 * r0['plan_seconds']:.1f} ms; gradients equal "
        f"to {agreement:.1e} (relative)"
    )
    print(
        json.dumps(
            {
                "benchmark": "balance_run",
                "args": vars(args),
                "speedup": speedup,
                "grad_agreement": agreement,
                "ranks": results,
                "machine": machine(),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a forkrl.core.testing.models.SIZES size")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--long", type=int, default=2, help="groups with long prompts")
    ap.add_argument("--short", type=int, default=2, help="groups with short prompts")
    ap.add_argument("--P-long", dest="P_long", type=int, default=2048)
    ap.add_argument("--P-short", dest="P_short", type=int, default=64)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--R", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if (args.long + args.short) * args.G % args.ranks:
        ap.error("the step's rows must divide evenly over --ranks")
    if os.environ.get("FORKRL_BALANCE_RUN_RANK"):
        rank_main(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
