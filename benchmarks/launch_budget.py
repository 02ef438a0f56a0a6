"""What a tree step asks of a GPU, counted on the CPU: kernel launches, synchronisations, copies.

A GPU charges for what a CPU hides. Each ATen op is a kernel launch (microseconds of host time
whatever its size), each read of a device value stalls the host until the device drains, and each
host-to-device copy from pageable memory does too. This counts them at the Qwen2.5-0.5B structure
(24 layers, 14 heads, 2 KV heads, vocabulary 151936; tiny widths, so it runs on a CPU in seconds),
for one gradient call (``TreeExecutor.backward``) of each mode (keep mode level-batched and depth
first) against the plain computation
(micro-batches of ``--micro-batch`` right-padded sequences, one forward and backward each, the head
from the first scored position on as TRL's ``logits_to_keep`` runs it):

    ops        non-view ATen ops of the whole call
    syncs      synchronising ops inside the pass (``.item()``, ``nonzero``, ``unique``, ...)
    call       the same for the whole call (the coefficients' NaN check reads one value first)
    runs       decoder forwards
    moves      ``.to(device)`` calls of forkrl's core inside the pass

Shapes: ``one`` (one group, P=256, G=16, R=32) and ``math`` (32 groups of G=8, P=64, R=32: many
short prompts, as math RL has). Prints a table, then one line of JSON.

    .venv/bin/python -m benchmarks.launch_budget
"""

from __future__ import annotations

import argparse
import json

SHAPES = {"one": (1, 256, 16, 32), "math": (32, 64, 8, 32)}
# Method name -> TreeExecutor options ("keep" level-batches the units of many trees, copying short
# shared nodes below the prompts into their children; its depth-first pass is kept for what a level
# cannot run: recurrent state, sliding windows, images, replay).
METHODS = {
    "keep": {"mode": "keep", "collapse_tokens": 64},
    "keep-depth-first": {"mode": "keep", "level_batching": False},
    "replay": {"mode": "replay"},
    "packed": {"mode": "packed"},
}


def qwen_05b_structure(layers: int = 24):
    """Qwen2.5-0.5B's structure at tiny widths (hidden 56, MLP 64), random weights, sdpa."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=56,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config)


def rollouts(groups: int, prompt: int, group: int, response: int) -> tuple[list[list[int]], list[int]]:
    """``groups`` GRPO groups of random tokens: per group one prompt and ``group`` completions."""
    import torch

    g = torch.Generator().manual_seed(0)
    seqs, score_from = [], []
    for _ in range(groups):
        p = torch.randint(0, 1000, (prompt,), generator=g).tolist()
        for _ in range(group):
            seqs.append(p + torch.randint(0, 1000, (response,), generator=g).tolist())
            score_from.append(prompt)
    return seqs, score_from


def measure(shape: str, model, micro_batch: int) -> list[dict]:
    """One row per method (dense, then each mode) at ``shape``."""
    import torch

    from forkrl.core import PrefixForest, TreeExecutor
    from forkrl.core.testing.dispatch import count_call, count_dense

    groups, prompt, group, response = SHAPES[shape]
    seqs, score_from = rollouts(groups, prompt, group, response)
    forest = PrefixForest.build(seqs, score_from)
    coefs = [torch.ones(len(s) - a) for s, a in zip(seqs, score_from, strict=True)]
    rows = [dict(shape=shape, method="dense", **vars(count_dense(model, seqs, score_from, micro_batch)))]
    for method, options in METHODS.items():
        ex = TreeExecutor(model, **options).verify()  # the first-use probe, not counted
        ex.backward(forest, coefs)  # warm: the first call of a mode builds its kernels' checks
        counts = count_call(ex, lambda ex=ex: ex.backward(forest, coefs))
        rows.append(dict(shape=shape, method=method, **vars(counts)))
    model.zero_grad(set_to_none=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.common import machine, print_table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="one,math", help="comma-separated: " + ",".join(SHAPES))
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument(
        "--micro-batch", type=int, default=8, help="the plain computation's sequences per micro-batch"
    )
    args = ap.parse_args(argv)
    model = qwen_05b_structure(args.layers)
    rows = [r for shape in args.shapes.split(",") for r in measure(shape, model, args.micro_batch)]
    for r in rows:
        dense = next(d for d in rows if d["shape"] == r["shape"] and d["method"] == "dense")
        r["ops_vs_dense"] = round(r["ops"] / dense["ops"], 3)
    print_table(
        rows,
        [
            ("shape", "{}"),
            ("method", "{}"),
            ("ops", "{}"),
            ("ops_vs_dense", "{:.2f}x"),
            ("syncs", "{}"),
            ("call_syncs", "{}"),
            ("decoder_runs", "{}"),
            ("moves", "{}"),
        ],
    )
    result = {
        "benchmark": "launch_budget",
        "shapes": {k: SHAPES[k] for k in args.shapes.split(",")},
        "rows": rows,
        "machine": machine(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
