"""veRL's actor update on 2 gloo ranks with a skewed step: forkrl's ``tree_balance`` on and off.

One optimizer step (one ``update_actor`` mini-batch over the dp group): ``--long`` GRPO groups
with prompts of ``--P-long`` tokens and ``--short`` groups with prompts of ``--P-short``, every
group ``--G`` responses of ``--R`` tokens. The rows reach the ranks as veRL's driver sends them,
two ways: split in order (rank 0 gets the long-prompt groups) and after veRL's own length balancing
(``get_seqlen_balanced_partitions`` on ``calculate_workload``, as the v1 trainer's
``_balance_batch`` does: it spreads each long group over both ranks, which both compute its
prompt). Each rank trains them with forkrl's ``fsdp2_tree`` engine through veRL's real
``TrainingWorker`` (FSDP2, SGD): with ``tree_balance: off`` for both splits, and with
``tree_balance: auto`` after veRL's length balancing (the plan moves rows by tree cost; the cost
model is fitted online, from the 8th sample on). One worker per configuration, the same weights;
the configurations alternate step by step. Step time = the slowest rank's wall time of
``train_mini_batch`` from a barrier; median of ``--reps`` after one warm-up. The three updates are
the same (one mini-batch per step, veRL's global normalisation): the parameters are compared
(largest difference over the largest change).

    .venv-verl/bin/python -m benchmarks.verl_balance                   # tiny Llama, a few minutes
    .venv-verl/bin/python -m benchmarks.verl_balance --P-long 128 --P-short 16 --R 16 --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

CONFIGS = (("in order", "off"), ("veRL length", "off"), ("veRL length", "auto"))


def step_rollouts(args, vocab: int) -> list[tuple[list[int], list[int]]]:
    """The step's (prompt, response) rows, long-prompt groups first."""
    rng = random.Random(0)
    out = []
    for P in [args.P_long] * args.long + [args.P_short] * args.short:
        prompt = [rng.randrange(vocab - 2) for _ in range(P)]
        out.extend((prompt, [rng.randrange(vocab - 2) for _ in range(args.R)]) for _ in range(args.G))
    return out


def splits(rollouts, world: int) -> dict[str, list[list[int]]]:
    """Per split, each rank's row indices: in order, and as veRL's driver balances by length."""
    import torch
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    n = len(rollouts) // world
    lengths = torch.tensor([len(p) + len(r) for p, r in rollouts], dtype=torch.int64)
    parts = get_seqlen_balanced_partitions(calculate_workload(lengths), k_partitions=world, equal_size=True)
    return {
        "in order": [list(range(r * n, (r + 1) * n)) for r in range(world)],
        "veRL length": [list(p) for p in parts],
    }


def rank_batch(rollouts, ids: list[int]):
    """The rows ``ids`` as veRL's trainer hands them to the actor (left-right padded, then veRL's
    no-padding layout); each row's advantage and old log-probs are its own, wherever it lands."""
    import torch
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    P = max(len(rollouts[i][0]) for i in ids)
    R = max(len(rollouts[i][1]) for i in ids)
    ids_t = torch.zeros(len(ids), P + R, dtype=torch.long)
    mask = torch.zeros_like(ids_t)
    old = torch.zeros(len(ids), R)
    adv = torch.zeros(len(ids), R)
    for b, i in enumerate(ids):
        p, r = rollouts[i]
        ids_t[b, P - len(p) : P], mask[b, P - len(p) : P] = torch.tensor(p), 1
        ids_t[b, P : P + len(r)], mask[b, P : P + len(r)] = torch.tensor(r), 1
        g = torch.Generator().manual_seed(i)
        old[b, : len(r)] = torch.randn(len(r), generator=g) * 0.2 - 5.5
        adv[b, : len(r)] = torch.randn(1, generator=g)
    fields = {
        "input_ids": ids_t,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "prompts": ids_t[:, :P],
        "responses": ids_t[:, P:],
        "response_mask": mask[:, P:].clone(),
        "old_log_probs": old,
        "advantages": adv,
    }
    return left_right_2_no_padding(TensorDict(fields, batch_size=[len(ids)]))


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from forkrl.core.testing.models import llama, save_pretrained, word_tokenizer
    from forkrl.core.testing.ranks import finish, report
    from forkrl.core.testing.stock import relative_difference
    from forkrl.plugins.verl import testing as h

    h.start()  # veRL on the CPU, in the gloo group torchrun described
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = llama(args.model)
    vocab = model.config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model")
        save_pretrained(model, word_tokenizer(vocab), path)  # every rank its own copy of the same weights
        rollouts = step_rollouts(args, vocab)
        mini = len(rollouts)

        def actor(balance: str):  # one config per engine: an engine renames its config's backend
            return h.actor_config(
                {"tree_packing": True, "tree_mode": "keep", "tree_balance": balance},
                ppo_mini_batch_size=mini,
                ppo_micro_batch_size_per_gpu=args.micro_batch,
            )

        workers = {c: h.worker(path, actor(c[1]), lr=1.0) for c in CONFIGS}
        assert all(type(w.engine).__name__ == "TreeFSDPEngineWithLMHead" for w in workers.values())
        dist.barrier()
    init = h.parameters(workers[CONFIGS[0]])
    split = splits(rollouts, world)
    batches = {c: rank_batch(rollouts, split[c[0]][rank]) for c in CONFIGS}
    times: dict = {c: [] for c in CONFIGS}
    moved: dict = {}
    for rep in range(args.reps + 1):
        for c in CONFIGS:
            dist.barrier()
            start = time.perf_counter()
            metrics = h.update(workers[c], batches[c], mini, entropy=False)
            wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            if rep > 0:  # the first round warms up
                times[c].append(float(wall))
            value = metrics.get("tree/balance_moved_rows")
            moved[c] = value[0] if isinstance(value, list) else value
    params = {c: h.parameters(workers[c]) for c in CONFIGS}
    base = params[CONFIGS[0]]
    agreement = max(relative_difference(base, params[c], init) for c in CONFIGS[1:])
    out = {
        "rank": rank,
        "rows": {f"{s} / {b}": split[s][rank] for s, b in CONFIGS},
        "step_s": {f"{s} / {b}": statistics.median(times[(s, b)]) for s, b in CONFIGS},
        "moved_rows": {f"{s} / {b}": moved[(s, b)] for s, b in CONFIGS},
        "param_agreement": agreement,
    }
    report("RESULT " + json.dumps(out))
    finish()


def launch(args) -> None:
    """Start 2 ranks of this script (torchrun) and print their table and JSON."""
    from benchmarks.common import machine, print_table, run_ranks

    results = run_ranks("benchmarks.verl_balance", "FORKRL_VERL_BALANCE_RANK")
    r0 = results[0]
    names = [f"{s} / {b}" for s, b in CONFIGS]
    base = r0["step_s"][names[1]]  # veRL's own length balancing, rows left there
    rows = [
        {
            "split / tree_balance": name,
            "long-prompt rows per rank, as sent": " / ".join(
                str(sum(1 for i in r["rows"][name] if i < args.long * args.G)) for r in results
            ),
            "rows moved": "-" if r0["moved_rows"][name] is None else f"{r0['moved_rows'][name]:.0f}",
            "step s": r0["step_s"][name],
            "vs veRL length": base / r0["step_s"][name],
        }
        for name in names
    ]
    print(
        f"veRL update_actor on 2 gloo ranks: model={args.model}, {args.long} groups P={args.P_long} + {args.short} "
        f"groups P={args.P_short}, G={args.G}, R={args.R}; median of {args.reps}"
    )
    print_table(
        rows,
        [
            ("split / tree_balance", "{}"),
            ("long-prompt rows per rank, as sent", "{}"),
            ("rows moved", "{}"),
            ("step s", "{:.2f}"),
            ("vs veRL length", "{:.2f}x"),
        ],
    )
    agreement = max(r["param_agreement"] for r in results)
    speedup = base / r0["step_s"][names[2]]
    print(
        f"tree_balance {speedup:.2f}x faster than veRL's length balancing; parameters equal to {agreement:.1e}"
    )
    print(
        json.dumps(
            {
                "benchmark": "verl_balance",
                "args": vars(args),
                "speedup": speedup,
                "speedup_vs_in_order": r0["step_s"][names[0]] / r0["step_s"][names[2]],
                "param_agreement": agreement,
                "ranks": results,
                "machine": machine(),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a forkrl.core.testing.models.SIZES size")
    ap.add_argument("--long", type=int, default=2, help="groups with long prompts")
    ap.add_argument("--short", type=int, default=2, help="groups with short prompts")
    ap.add_argument("--P-long", dest="P_long", type=int, default=2048)
    ap.add_argument("--P-short", dest="P_short", type=int, default=64)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--R", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4, help="ppo_micro_batch_size_per_gpu")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if (args.long + args.short) * args.G % 2:
        ap.error("the step's rows must divide evenly over the 2 ranks")
    if os.environ.get("FORKRL_VERL_BALANCE_RANK"):
        rank_main(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
