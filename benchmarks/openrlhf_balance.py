"""OpenRLHF's actor training on 2 gloo ranks with a skewed step: ``--forkrl.tree_balance`` on and off.

Each rank's replay buffer holds its own rollouts, as OpenRLHF's experience makers leave them:
rank 0 ``--groups`` GRPO groups with prompts of ``--P-long`` tokens, rank 1 as many with prompts of
``--P-short``, every group ``--G`` responses of ``--R`` tokens; one optimizer step per
``ppo_train`` (``--train.batch_size`` = every rank's rows). Both ranks train with forkrl's tree
trainer (OpenRLHF's real ``ActorPPOTrainer`` subclass around a real DeepSpeed ZeRO-2 engine, SGD):
``--forkrl.tree_balance off`` leaves the rows where they are, so rank 1 waits for rank 0 at
DeepSpeed's reduction; ``auto`` moves each window's rows by tree cost first (groups kept whole,
equal rows per rank; the cost model is fitted online, from the 8th sample on). One trainer per
setting, the same weights; the settings alternate step by step. Step time = the slowest rank's wall
time of ``ppo_train`` from a barrier; median of ``--reps`` after one warm-up. The two updates are
the same (OpenRLHF's global normalisers): the parameters are compared (largest difference over
the largest change). Prints a table, then one
line of JSON. Runs in OpenRLHF's environment:

    .venv-openrlhf/bin/python -m benchmarks.openrlhf_balance            # tiny Llama, a few minutes
    .venv-openrlhf/bin/python -m benchmarks.openrlhf_balance --P-long 96 --P-short 8 --R 8 --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("off", "auto")


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from forkrl.core.testing.models import llama
    from forkrl.core.testing.ranks import finish, report
    from forkrl.core.testing.stock import relative_difference
    from forkrl.plugins.openrlhf import testing as h

    h.start()  # the gloo group torchrun described

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = args.groups * args.G
    g = torch.Generator().manual_seed(10 + rank)
    P = args.P_long if rank == 0 else args.P_short
    groups = []
    for _ in range(args.groups):
        prompt = torch.randint(0, 250, (P,), generator=g).tolist()
        groups.append(
            [(prompt, torch.randint(0, 250, (args.R,), generator=g).tolist()) for _ in range(args.G)]
        )
    experiences = [h.experience(group, seed=10 * rank + k, kl=False) for k, group in enumerate(groups)]

    def build(balance: str):
        argv = h.command(
            "unused", "--forkrl.tree_packing", "--forkrl.tree_mode", "keep", "--forkrl.tree_balance", balance,
            micro_batch=args.micro_batch, batch=rows * world,
        )  # fmt: skip
        argv[argv.index("--rollout.n_samples_per_prompt") + 1] = str(args.G)
        argv[argv.index("--rollout.micro_batch_size") + 1] = str(args.G)
        torch.manual_seed(0)
        model = llama(args.model, max_pos=max(4096, args.P_long + args.R))
        return h.trainer(h.parse_args(argv), forkrl=True, model=model, lr=1.0)

    trainers = {s: build(s) for s in SETTINGS}
    init = h.parameters(trainers["off"])
    times: dict = {s: [] for s in SETTINGS}
    moved: dict = {}
    for rep in range(args.reps + 1):
        for s in SETTINGS:
            t = trainers[s]
            h.fill(t, experiences)
            torch.manual_seed(123)  # the DataLoader's shuffle
            dist.barrier()
            start = time.perf_counter()
            with h.cpu():
                status = t.ppo_train(0.0)
            wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            t.replay_buffer.clear()
            if rep > 0:  # the first round warms up
                times[s].append(float(wall))
            moved[s] = status.get("tree/balance_moved_rows")
    params = {s: h.parameters(trainers[s]) for s in SETTINGS}
    agreement = relative_difference(params["off"], params["auto"], init)
    out = {
        "rank": rank,
        "step_s": {s: statistics.median(times[s]) for s in SETTINGS},
        "moved_rows": moved,
        "accumulated_gradient": trainers["off"].strategy.accumulated_gradient,
        "param_agreement": agreement,
    }
    report("RESULT " + json.dumps(out))
    finish()


def launch(args) -> None:
    from benchmarks.common import machine, print_table, run_ranks

    results = run_ranks("benchmarks.openrlhf_balance", "FORKRL_OPENRLHF_BALANCE_RANK")
    r0 = results[0]
    rows = [
        {
            "tree_balance": s,
            "rows moved": "-" if r0["moved_rows"][s] is None else f"{r0['moved_rows'][s]:.0f}",
            "step s": r0["step_s"][s],
            "vs off": r0["step_s"]["off"] / r0["step_s"][s],
        }
        for s in SETTINGS
    ]
    print(
        f"OpenRLHF ppo_train on 2 gloo ranks (ZeRO-2): model={args.model}; rank 0 {args.groups} groups P={args.P_long}, "
        f"rank 1 {args.groups} groups P={args.P_short}; G={args.G}, R={args.R}, micro-batches of {args.micro_batch} "
        f"({r0['accumulated_gradient']} per step); median of {args.reps}"
    )
    print_table(
        rows, [("tree_balance", "{}"), ("rows moved", "{}"), ("step s", "{:.2f}"), ("vs off", "{:.2f}x")]
    )
    agreement = max(r["param_agreement"] for r in results)
    speedup = r0["step_s"]["off"] / r0["step_s"]["auto"]
    print(f"tree_balance {speedup:.2f}x faster; parameters equal to {agreement:.1e}")
    print(
        json.dumps(
            {
                "benchmark": "openrlhf_balance",
                "args": vars(args),
                "speedup": speedup,
                "param_agreement": agreement,
                "ranks": results,
                "machine": machine(),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a forkrl.core.testing.models.SIZES size")
    ap.add_argument("--groups", type=int, default=2, help="GRPO groups per rank")
    ap.add_argument("--P-long", dest="P_long", type=int, default=2048, help="rank 0's prompt tokens")
    ap.add_argument("--P-short", dest="P_short", type=int, default=64, help="rank 1's prompt tokens")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--R", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4, help="--train.micro_batch_size")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if os.environ.get("FORKRL_OPENRLHF_BALANCE_RANK"):
        sys.path.insert(0, str(REPO))
        rank_main(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
