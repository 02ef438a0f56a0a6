"""Communication per optimizer step under DeepSpeed ZeRO-3: OpenRLHF's actor training against forkrl's.

Two gloo ranks, OpenRLHF's real ``ActorPPOTrainer`` (stock, and forkrl's subclass) around a real
DeepSpeed ZeRO-3 engine (every parameter partitioned: ``stage3_param_persistence_threshold=0``),
one optimizer step per rank of ``--micro-batches`` micro-batches of 2 rows (GRPO groups: prompts of
``--P`` tokens, responses of ``--R``), through OpenRLHF's replay buffer and ``ppo_train``:

    stock   OpenRLHF: per micro-batch, ZeRO-3 gathers each layer in the forward and again in the
            backward, and reduce-scatters the gradients
    tree    forkrl: every partition gathered once for the step, the whole forest on an aliasing
            replica, the step's gradient handed to DeepSpeed's backward once (its reduce-scatter)

Every collective issued inside ``ppo_train`` is counted where it is dispatched (the dispatch mode of
``benchmarks.sharded_comm``): calls and buffer bytes per rank. ``--forkrl.tree_balance off``: the
engine's traffic alone (the balancer adds one gather of the window's rows per step). Prints a table,
then one line of JSON.
Runs in OpenRLHF's environment (``.venv-openrlhf``):

    .venv-openrlhf/bin/python -m benchmarks.zero3_comm          # tiny Llama, 2 micro-batches, about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PATHS = ("stock", "tree")


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.sharded_comm import KINDS, counter
    from forkrl.core.testing.models import llama
    from forkrl.core.testing.ranks import finish, report
    from forkrl.plugins.openrlhf import testing as h

    h.start()  # the gloo group torchrun described

    rank = dist.get_rank()
    rows = 2 * args.micro_batches
    # The engine's traffic only: the balancer's gather of the rows' tokens (tree_balance) is off here.
    argv = h.command(
        "unused", "--forkrl.tree_packing", "--forkrl.tree_balance", "off", micro_batch=2,
        batch=rows * dist.get_world_size(),
    )  # fmt: skip
    argv[argv.index("--ds.zero_stage") + 1] = "3"
    argv[argv.index("--rollout.n_samples_per_prompt") + 1] = str(rows)
    argv[argv.index("--rollout.micro_batch_size") + 1] = str(rows)
    ppo_args = h.parse_args(argv)
    g = torch.Generator().manual_seed(10 + rank)
    prompt = torch.randint(0, 250, (args.P,), generator=g).tolist()
    group = [(prompt, torch.randint(0, 250, (args.R,), generator=g).tolist()) for _ in range(rows)]
    result: dict = {"rank": rank}
    for name in PATHS:
        torch.manual_seed(0)
        model = llama(args.model, max_pos=max(4096, args.P + args.R))
        result["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        t = h.trainer(ppo_args, forkrl=name == "tree", model=model)
        h.fill(t, [h.experience(group, seed=rank, kl=False)])
        torch.manual_seed(1)
        dist.barrier()
        mode = counter()
        with mode, h.cpu():
            status = t.ppo_train(0.0)
        result[name] = {k: {"calls": mode.calls.get(k, 0), "bytes": mode.bytes.get(k, 0)} for k in KINDS}
        result[name]["accumulated_gradient"] = t.strategy.accumulated_gradient
        result[name]["policy_loss"] = float(status["policy_loss"])
    report("RESULT " + json.dumps(result))
    finish()


def launch(args) -> None:
    from benchmarks.common import machine, print_table, run_ranks
    from benchmarks.sharded_comm import KINDS, table_rows

    results = run_ranks("benchmarks.zero3_comm", "FORKRL_ZERO3_COMM_RANK")
    r0 = results[0]
    rows = table_rows(r0, PATHS)
    for row in rows:
        row["vs_stock"] = row["total_mib"] / rows[0]["total_mib"]
    print(
        f"DeepSpeed ZeRO-3 on 2 gloo ranks, model={args.model} ({r0['model_bytes'] / 2**20:.1f} MiB of parameters), "
        f"one optimizer step of {r0['stock']['accumulated_gradient']} micro-batches of 2 rows (P={args.P}, "
        f"R={args.R}) per rank; rank 0's collectives inside ppo_train (calls / MiB)"
    )
    cols = [("path", "{}")] + [(k, "{}") for k in KINDS]
    cols += [("total_mib", "{:.1f}"), ("over_model", "{:.2f}"), ("vs_stock", "{:.2f}")]
    print_table(rows, cols)
    losses = [(r["stock"]["policy_loss"], r["tree"]["policy_loss"]) for r in results]
    print(
        json.dumps(
            {"benchmark": "zero3_comm", "machine": machine(), "rows": rows, "losses": losses, "raw": results}
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="micro, tiny, mini or small")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per rank in the step")
    ap.add_argument("--P", type=int, default=256)
    ap.add_argument("--R", type=int, default=32)
    args = ap.parse_args()
    if os.environ.get("FORKRL_ZERO3_COMM_RANK"):
        sys.path.insert(0, str(REPO))
        rank_main(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
