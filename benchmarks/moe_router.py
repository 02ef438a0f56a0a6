"""Tree training of a MoE model with its router load-balancing loss, against the plain path.

One GRPO step (a prompt of P tokens, G completions of R) of a Qwen3-MoE-shaped model with
``router_aux_loss_coef`` on, timed side by side in one process:

    dense        the host's path: one padded forward of the group with output_router_logits,
                 the log-prob functional plus coef * aux_loss, one backward
    tree         TreeExecutor keep mode with the RouterLoss: a decoder-only counting pass, then
                 the tree backward with each unit's router term (the on-policy fused path)
    tree_scored  the same after a scoring pass (the general path: the counts come from it, so the
                 scoring pass is not charged here, as the host needs it anyway)
    tree_noaux   the tree without the router loss (what the router loss costs on the tree)

Prints a table and a last line of JSON.

    .venv/bin/python -m benchmarks.moe_router --P 512 --G 8 --R 128 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from benchmarks.common import machine, print_table, timed
from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.executor import RouterLoss

COEF = 0.01
SIZES = {  # hidden, layers, heads, experts, top-k, expert width, vocab
    "micro": (64, 2, 4, 4, 2, 32, 1024),
    "mini": (256, 4, 4, 8, 2, 256, 32000),
}


def moe_model(size: str):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hidden, layers, heads, experts, top_k, width, vocab = SIZES[size]
    cfg = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        num_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=8192,
        router_aux_loss_coef=COEF,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).float().train()


def dense_step(model, seqs, sf, coefs) -> None:
    ids = torch.stack(seqs)
    out = model(
        input_ids=ids, attention_mask=torch.ones_like(ids), output_router_logits=True, logits_to_keep=0
    )
    logits = out.logits[:, sf - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, sf:, None])[..., 0]
    ((lp * torch.stack(coefs)).sum() + COEF * out.aux_loss).backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="mini", choices=sorted(SIZES))
    ap.add_argument("--P", type=int, default=512)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--R", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3, help="round-robin runs per method; the median is kept")
    args = ap.parse_args()

    model = moe_model(args.size)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (args.P,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(0, vocab, (args.R,), generator=g)]) for _ in range(args.G)]
    coefs = [torch.randn(args.R, generator=g) / (args.G * args.R) for _ in range(args.G)]
    forest = PrefixForest.build(seqs, [args.P] * args.G)
    ex = TreeExecutor(model).verify()

    def tree(aux: bool, scored: bool = False):
        router = RouterLoss([COEF]).bind(forest, [0, args.G]) if aux else None
        if scored:
            ex.score(forest, router=router)  # not timed: the general path's scoring pass
        return lambda: ex.backward(forest, coefs, router=router)

    methods = {
        "dense": lambda: lambda: dense_step(model, seqs, args.P, coefs),
        "tree": lambda: tree(True),
        "tree_scored": lambda: tree(True, scored=True),
        "tree_noaux": lambda: tree(False),
    }
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.repeat):
        for name, make in methods.items():
            fn = make()
            model.zero_grad(set_to_none=True)
            seconds, _ = timed(fn)
            times[name].append(seconds)
            print(f"  {name}: {seconds:.2f}s", file=sys.stderr, flush=True)
    row = {"size": args.size, "P": args.P, "G": args.G, "R": args.R, "compression": forest.compression}
    for name, ts in times.items():
        row[f"{name}_s"] = statistics.median(ts)
    for name in ("tree", "tree_scored", "tree_noaux"):
        row[f"{name}_speedup"] = row["dense_s"] / row[f"{name}_s"]
    row["router_cost"] = row["tree_s"] / row["tree_noaux_s"]
    print_table(
        [row],
        [
            ("size", "{}"),
            ("P", "{}"),
            ("G", "{}"),
            ("R", "{}"),
            ("compression", "{:.2f}"),
            ("dense_s", "{:.2f}"),
            ("tree_s", "{:.2f}"),
            ("tree_scored_s", "{:.2f}"),
            ("tree_noaux_s", "{:.2f}"),
            ("tree_speedup", "{:.2f}x"),
            ("tree_scored_speedup", "{:.2f}x"),
            ("router_cost", "{:.2f}"),
        ],
    )
    print(json.dumps({"benchmark": "moe_router", "machine": machine(), "rows": [row]}))


if __name__ == "__main__":
    main()
