"""Communication per optimizer step under FSDP2: stock against forkrl's tree step, bytes counted.

Two gloo ranks, a Llama with ``fully_shard`` on every decoder layer and on the root (as veRL and
accelerate apply it, ``reshard_after_forward=True``). One optimizer step of ``--micro-batches``
micro-batches per rank (each a GRPO group: a prompt of ``--P`` tokens, ``--G`` completions of
``--R``), the loss a log-prob functional:

    stock-sync-last   FSDP2 forward + backward per micro-batch, gradient sync only on the last
                      (``set_requires_gradient_sync(False)`` before: accelerate's accumulation)
    stock-sync-each   the same with a reduce-scatter after every micro-batch (veRL's engine)
    tree              forkrl's TreeStep: one all-gather into a plain replica, the whole forest
                      there, one reduce-scatter into FSDP's sharded gradients

Every collective issued inside the step is counted where it is dispatched (each ``c10d`` and
``_c10d_functional`` op, by a dispatch mode): calls and buffer bytes (the larger of its input and
output tensors, per rank). Prints a table, then one line of JSON.

    .venv/bin/python -m benchmarks.sharded_comm                    # tiny Llama, about a minute
    .venv/bin/python -m benchmarks.sharded_comm --model micro --micro-batches 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "other")


def _kind(name: str) -> str:
    if "allgather" in name or "all_gather" in name:
        return "all_gather"
    if "reduce_scatter" in name:
        return "reduce_scatter"
    if "allreduce" in name or "all_reduce" in name:
        return "all_reduce"
    return "other"


def counter():
    """A dispatch mode that counts collectives: ``mode.calls[kind]``, ``mode.bytes[kind]``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    def tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from tensors(y)

    class Collectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[str, int] = defaultdict(int)
            self.bytes: dict[str, int] = defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func)
            if ("c10d" in name) and "wait" not in name and "wrap_tensor" not in name:
                size = max([t.nbytes for t in tensors(args)] + [t.nbytes for t in tensors(out)] + [0])
                self.calls[_kind(name)] += 1
                self.bytes[_kind(name)] += size
            return out

    return Collectives()


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from forkrl.core import RowLayout, TreeOptions, TreeStep
    from forkrl.core.testing.models import dense_logprobs, llama
    from forkrl.core.testing.ranks import finish, report

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = llama(args.model)
    vocab = model.config.vocab_size
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # a DTensor's numel is global

    g = torch.Generator().manual_seed(10 + rank)
    batches = []
    for _ in range(args.micro_batches):
        prompt = torch.randint(0, vocab, (args.P,), generator=g).tolist()
        seqs = [prompt + torch.randint(0, vocab, (args.R,), generator=g).tolist() for _ in range(args.G)]
        coefs = [torch.randn(args.R, generator=g) / (args.G * args.R) for _ in range(args.G)]
        batches.append((seqs, coefs))

    def stock(sync_each: bool) -> None:
        for i, (seqs, coefs) in enumerate(batches):
            model.set_requires_gradient_sync(sync_each or i == len(batches) - 1)
            lps, _ = dense_logprobs(model, seqs, [args.P] * args.G)
            sum((lp * c).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
        model.set_requires_gradient_sync(True)

    def tree() -> None:
        layouts = [RowLayout.spans([torch.tensor(s) for s in seqs], [args.P] * args.G) for seqs, _ in batches]
        flat = [torch.cat(coefs) for _, coefs in batches]

        def loss_fn(i, lp, ent):
            return (lp[layouts[i].mask(lp.device)] * flat[i]).sum()

        TreeStep(TreeOptions(tree_packing=True)).train(model, layouts, loss_fn)

    result = {"rank": rank, "model_bytes": params}
    for name, fn in (
        ("stock-sync-last", lambda: stock(False)),
        ("stock-sync-each", lambda: stock(True)),
        ("tree", tree),
    ):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        mode = counter()
        with mode:
            fn()
        result[name] = {k: {"calls": mode.calls.get(k, 0), "bytes": mode.bytes.get(k, 0)} for k in KINDS}
    report("RESULT " + json.dumps(result))  # rank 0 prints every rank's line: ranks' own prints interleave
    finish()


def table_rows(record: dict, paths: tuple[str, ...]) -> list[dict]:
    """One table row per path of a rank's RESULT record: calls / MiB per kind, the total, x model."""
    rows = []
    for name in paths:
        row = {"path": name}
        total = 0
        for kind in KINDS:
            c = record[name][kind]
            row[kind] = f"{c['calls']} / {c['bytes'] / 2**20:.1f}"
            total += c["bytes"]
        row["total_mib"] = total / 2**20
        row["over_model"] = total / record["model_bytes"]
        rows.append(row)
    return rows


def launch(args) -> None:
    from benchmarks.common import machine, print_table, run_ranks

    results = run_ranks("benchmarks.sharded_comm", "FORKRL_SHARDED_COMM_RANK")
    r0 = results[0]
    rows = table_rows(r0, ("stock-sync-last", "stock-sync-each", "tree"))
    base = rows[0]["total_mib"]
    for row in rows:
        row["vs_stock_sync_last"] = row["total_mib"] / base if base else float("nan")
    print(
        f"FSDP2 on 2 gloo ranks, model={args.model} ({r0['model_bytes'] / 2**20:.1f} MiB of parameters), "
        f"{args.micro_batches} micro-batches of P={args.P} G={args.G} R={args.R} per rank; rank 0's collectives "
        "(calls / MiB)"
    )
    print_table(
        rows,
        [
            ("path", "{}"),
            ("all_gather", "{}"),
            ("reduce_scatter", "{}"),
            ("all_reduce", "{}"),
            ("other", "{}"),
            ("total_mib", "{:.1f}"),
            ("over_model", "{:.2f}"),
            ("vs_stock_sync_last", "{:.2f}"),
        ],
    )
    same = all(r[name] == results[0][name] for r in results for name in ("tree",))
    print(
        json.dumps(
            {
                "benchmark": "sharded_comm",
                "machine": machine(),
                "ranks_agree": same,
                "rows": rows,
                "raw": results,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="micro, tiny, mini or small")
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--P", type=int, default=256)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--R", type=int, default=32)
    args = ap.parse_args()
    if os.environ.get("FORKRL_SHARDED_COMM_RANK"):
        sys.path.insert(0, str(REPO))
        rank_main(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
