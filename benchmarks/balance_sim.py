"""Data-parallel balancing toward scale, simulated: slowest rank's predicted cost over the lower bound.

Rollout shapes a user meets, each step ``--groups-per-rank`` trees per rank of 8 sequences each:

- ``grpo``: GRPO groups, prompts log-normal (median 1024 tokens), responses long-tailed (log-normal,
  median 384, sigma 1.0, capped at 16k);
- ``multiturn``: agent trees whose 8 trajectories branch at random turns (depth 1-5 turns after the
  prompt, turns log-normal with median 256 tokens);
- ``mixed``: GRPO groups whose prompts are short (256) or, one in five, long (16k).

Assignments compared (every rank gets the same number of rows, as veRL and OpenRLHF require):
``none`` (rows as the rollout produced them, contiguous per rank: groups whole, cost ignored),
``length`` (longest row first to the least-loaded rank by summed length: a stand-in for veRL's
Karmarkar-Karp on sequence lengths, which likewise ignores shared prefixes and scatters groups),
``tree`` (:func:`forkrl.core.balance.balance`). Cost: :class:`~forkrl.core.balance.CostModel`
with per-token 1, per attended query-key pair 3.7e-5 (a 7B Llama's attention FLOPs per pair over
its linear FLOPs per token) and per unit 150 (launch overhead in token-equivalents); costs are
predictions, not timings. The lower bound is max(total tree cost / ranks, the costliest single row);
``tree_any_rows`` is the balancer without the equal-row constraint; ``tree_vs_rows_bound`` divides
by the bound under equal row counts instead
(:func:`~forkrl.core.balance.rows_bound`: the rank with the costliest row holds as many rows as
every other, each adding at least its own last node).

    .venv/bin/python -m benchmarks.balance_sim                       # 8, 64, 512, 4096 ranks, all shapes
    .venv/bin/python -m benchmarks.balance_sim --ranks 8,64 --shapes grpo
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import time

from benchmarks.common import machine, print_table
from forkrl.core.balance import CostModel, Tree, balance, evaluate, rows_bound

MODEL = CostModel(per_token=1.0, per_attended=3.7e-5, per_unit=150.0)
G = 8


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def _group(prompt: int, responses: list[int], first_id: int) -> Tree:
    lengths, starts, parent = [prompt], [0], [-1]
    for r in responses:
        lengths.append(r)
        starts.append(prompt)
        parent.append(0)
    return Tree(
        lengths,
        starts,
        parent,
        list(range(first_id, first_id + len(responses))),
        [[0, k + 1] for k in range(len(responses))],
    )


def _multiturn(rng: random.Random, first_id: int) -> Tree:
    tree = Tree([_lognormal(rng, 1024, 0.8, 64, 16384)], [0], [-1], [], [])

    def grow(node: int, leaves: int, path: list[int], depth: int) -> None:
        if leaves == 1 and (depth >= 1 and rng.random() < 0.4 or depth >= 5):
            tree.ids.append(first_id + len(tree.ids))
            tree.paths.append(path)
            return
        parts = [leaves] if leaves == 1 else _split(rng, leaves)
        for part in parts:
            tree.lengths.append(_lognormal(rng, 256, 1.0, 8, 8192))
            tree.starts.append(tree.starts[node] + tree.lengths[node])
            tree.parent.append(node)
            child = len(tree.lengths) - 1
            grow(child, part, [*path, child], depth + 1)

    grow(0, G, [0], 0)
    return tree


def _split(rng: random.Random, n: int) -> list[int]:
    k = rng.choice([1, 2, 2, 3]) if n > 1 else 1
    cuts = sorted(rng.sample(range(1, n), min(k - 1, n - 1)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]


def trees_for(shape: str, count: int, seed: int) -> list[Tree]:
    rng = random.Random(f"{shape}-{seed}")
    trees = []
    for i in range(count):
        if shape == "multiturn":
            trees.append(_multiturn(rng, i * G))
            continue
        if shape == "grpo":
            prompt = _lognormal(rng, 1024, 0.8, 64, 16384)
        else:  # mixed
            prompt = 16384 if rng.random() < 0.2 else 256
        responses = [_lognormal(rng, 384, 1.0, 8, 16384) for _ in range(G)]
        trees.append(_group(prompt, responses, i * G))
    return trees


def _row_lengths(trees: list[Tree]) -> dict[int, int]:
    out = {}
    for t in trees:
        for s, path in zip(t.ids, t.paths, strict=True):
            out[s] = sum(t.lengths[n] for n in path)
    return out


def by_length(trees: list[Tree], ranks: int, rows_per_rank: int) -> list[list[int]]:
    lengths = _row_lengths(trees)
    heap = [(0, r) for r in range(ranks)]
    out: list[list[int]] = [[] for _ in range(ranks)]
    for s in sorted(lengths, key=lambda s: -lengths[s]):
        full = []
        load, r = heapq.heappop(heap)
        while len(out[r]) >= rows_per_rank:
            full.append((load, r))
            load, r = heapq.heappop(heap)
        out[r].append(s)
        heapq.heappush(heap, (load + lengths[s], r))
        for item in full:
            heapq.heappush(heap, item)
    return out


def run(shape: str, ranks: int, groups_per_rank: int, seed: int) -> dict:
    trees = trees_for(shape, ranks * groups_per_rank, seed)
    rows = groups_per_rank * G
    ids = [s for t in trees for s in t.ids]
    none = evaluate(trees, [ids[r * rows : (r + 1) * rows] for r in range(ranks)], MODEL)
    length = evaluate(trees, by_length(trees, ranks, rows), MODEL)
    start = time.perf_counter()
    tree = balance(trees, ranks, MODEL, rows_per_rank=rows)
    seconds = time.perf_counter() - start
    bound = max(tree.lower_bound, rows_bound(trees, MODEL, rows))
    free = balance(trees, ranks, MODEL)  # without equal row counts
    return {
        "shape": shape,
        "ranks": ranks,
        "rows": len(ids),
        "none": none.makespan_ratio,
        "length": length.makespan_ratio,
        "tree": tree.makespan_ratio,
        "tree_vs_rows_bound": tree.makespan / bound,
        "tree_any_rows": free.makespan_ratio,
        "tree_vs_length": tree.makespan / length.makespan,
        "split_trees": tree.split_trees,
        "balancer_s": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8,64,512,4096")
    ap.add_argument("--shapes", default="grpo,multiturn,mixed")
    ap.add_argument("--groups-per-rank", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = [
        run(shape, int(r), args.groups_per_rank, args.seed)
        for shape in args.shapes.split(",")
        for r in args.ranks.split(",")
    ]
    print(f"slowest rank / lower bound (predicted cost), {args.groups_per_rank} trees of {G} rows per rank")
    print_table(
        rows,
        [
            ("shape", "{}"),
            ("ranks", "{}"),
            ("rows", "{}"),
            ("none", "{:.3f}"),
            ("length", "{:.3f}"),
            ("tree", "{:.3f}"),
            ("tree_vs_rows_bound", "{:.3f}"),
            ("tree_any_rows", "{:.3f}"),
            ("tree_vs_length", "{:.3f}"),
            ("split_trees", "{}"),
            ("balancer_s", "{:.3f}"),
        ],
    )
    print(json.dumps({"benchmark": "balance_sim", "model": vars(MODEL), "rows": rows, "machine": machine()}))


if __name__ == "__main__":
    main()
