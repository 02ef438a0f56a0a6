"""Tree training against dense training on GRPO-shaped batches (one prompt, G completions).

For each model size, prompt length P and group size G, one optimizer-step's worth of forward and
backward (the gradient of sum(coef * logprob) over the completions) runs as:
    dense   padded per-sequence batches (micro-batches of --dense-tokens tokens), the plain path
    keep    TreeExecutor(mode="keep"): sibling leaves forwarded and backpropagated as batches
    keep1   TreeExecutor(mode="keep", leaf_batch_tokens=1): one leaf at a time (not in the default
            --methods; add it to see what batching the siblings gives)
    keepdf  TreeExecutor(mode="keep", level_batching=False): the depth-first pass, one decoder run
            per root and per batch of siblings (not in the default --methods; with --groups it
            shows what running the units of a depth of many trees as one forward gives)
    replay  TreeExecutor(mode="replay", block_size=--block-size)
    packed  TreeExecutor(mode="packed"), the tree-attention-mask path
and no-grad scoring runs as dense vs TreeExecutor.score. Ratios are measured side by side in one
process. Prints a table, then one line of JSON.

    .venv/bin/python -m benchmarks.tree_training --models tiny --P 512 --G 4          # a minute
    .venv/bin/python -m benchmarks.tree_training --models small --P 2048 --G 16       # the target row
    .venv/bin/python -m benchmarks.tree_training --models tiny,small --P 512,2048,8192 --G 4,8,16
    .venv/bin/python -m benchmarks.tree_training --models tiny --groups 32 --P 256 --G 8 --R 128 \
        --methods dense,keep,keepdf --no-score --repeat 3                          # math RL: many groups
    .venv/bin/python -m benchmarks.tree_training --models tiny --P 256,1024,4096 --G 4,16 \
        --methods dense,keep --no-score --plot benchmarks/results/tree_training.png

``--plot FILE`` draws keep's speedup over dense against the prompt length, one line per group
size, with the ideal FLOP ratio of each beside it (dashed); matplotlib comes with the ``bench``
extra.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.common import machine, print_table, timed
from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.estimate.pricing import dense_step, grpo_batch  # noqa: F401 - re-exported for the other benchmarks
from forkrl.core.testing import SavedBytes, peak_rss_bytes
from forkrl.core.testing.models import flops_per_token, llama

REPO = Path(__file__).resolve().parents[1]  # the child process imports benchmarks from here


def ideal_flops(forest: PrefixForest, name: str, vocab: int | None = None) -> tuple[float, float]:
    """Forward FLOPs of (dense, tree): linear layers, attention over the causal context, LM head rows."""
    lin, att, head = flops_per_token(name, vocab)
    dense = sum(lin * n + att * n * (n + 1) / 2 for n in forest.lengths) + head * forest.scored_tokens
    tree = 0.0
    for node in forest.nodes:
        n, s = len(node.tokens), node.start
        tree += lin * n + att * (n * s + n * (n + 1) / 2)
    tree += head * forest.num_entries
    return dense, tree


def _model(name: str, args):
    return llama(name, **({"vocab_size": args.vocab} if args.vocab else {}))


def _executor(model, method: str, args) -> TreeExecutor:
    if method == "keep1":
        return TreeExecutor(model, mode="keep", leaf_batch_tokens=1)
    if method == "keepdf":
        return TreeExecutor(model, mode="keep", level_batching=False)
    return TreeExecutor(model, mode=method, block_size=args.block_size if method == "replay" else None)


def _time_methods(model, row: dict, methods, seqs, sf, coefs, forest, args) -> None:
    """Median seconds (``<method>_s``) of each method's step over ``--repeat`` round-robin runs
    (a slow spell of the machine hits every method), and its saved-tensor peak on the first."""
    meter = SavedBytes()
    fns = {}
    for method in methods:
        if method == "dense":
            fns[method] = lambda: dense_step(model, seqs, sf, coefs, args.dense_tokens, grad=True)
        else:
            ex = _executor(model, method, args)
            fns[method] = lambda ex=ex: ex.backward(forest, coefs)
    times: dict[str, list[float]] = {m: [] for m in fns}
    for rep in range(args.repeat):
        for method, fn in fns.items():
            model.zero_grad(set_to_none=True)
            with meter.measure() if rep == 0 else contextlib.nullcontext():
                seconds, _ = timed(fn)
            times[method].append(seconds)
            if rep == 0:
                row[f"{method}_saved_mb"] = meter.peak / 2**20
            print(
                f"  {row['model']} P={row['P']} G={row['G']} {method}: {seconds:.2f}s",
                file=sys.stderr,
                flush=True,
            )
    for method, ts in times.items():
        row[f"{method}_s"] = statistics.median(ts)


def _ratios(row: dict, methods) -> None:
    if "dense_s" in row:
        for m in methods:
            if m != "dense":
                row[f"{m}_speedup"] = row["dense_s"] / row[f"{m}_s"]
                row[f"{m}_achieved_over_ideal"] = row[f"{m}_speedup"] / row["ideal_flop_ratio"]
                row[f"{m}_over_ideal_tokens"] = row[f"{m}_speedup"] / row["ideal_token_ratio"]
    if "keep_s" in row and "keep1_s" in row:
        row["keep_over_keep1"] = row["keep1_s"] / row["keep_s"]
    if "keep_s" in row and "keepdf_s" in row:
        row["keep_over_keepdf"] = row["keepdf_s"] / row["keep_s"]
    if "keep_s" in row and "packed_s" in row:
        row["keep_over_packed"] = row["packed_s"] / row["keep_s"]


def _groups(P: int, G: int, R: int, vocab: int, groups: int):
    """``groups`` GRPO groups (a prompt and ``G`` completions each) as one step's sequences."""
    seqs, sf, coefs = [], [], []
    for k in range(groups):
        s, f, c = grpo_batch(P, G, R, vocab, seed=k)
        seqs, sf, coefs = seqs + s, sf + f, coefs + c
    return seqs, sf, coefs


def run_config(model, name, P, G, R, methods, args) -> dict:
    vocab = model.config.vocab_size
    seqs, sf, coefs = _groups(P, G, R, vocab, args.groups)
    forest = PrefixForest.build(seqs, sf)
    d_fl, t_fl = ideal_flops(forest, name, vocab)
    row = {
        "model": name,
        "groups": args.groups,
        "P": P,
        "G": G,
        "R": R,
        "ideal_token_ratio": forest.compression,
        "ideal_flop_ratio": d_fl / t_fl,
        "vocab": vocab,
    }
    if not args.score_only:
        _time_methods(model, row, methods, seqs, sf, coefs, forest, args)
        _ratios(row, methods)
    if args.score:
        model.zero_grad(set_to_none=True)
        ex = TreeExecutor(model, mode="keep")
        row["score_dense_s"], _ = timed(
            lambda: dense_step(model, seqs, sf, coefs, args.dense_tokens, grad=False)
        )
        row["score_tree_s"], _ = timed(lambda: ex.score(forest))
        row["score_speedup"] = row["score_dense_s"] / row["score_tree_s"]
        row["score_achieved_over_ideal_token"] = row["score_speedup"] / row["ideal_token_ratio"]
    return row


def plot(rows: list[dict], path: str, method: str = "keep") -> None:
    """PNG at ``path``: ``method``'s speedup over dense against P, one colour per (model, G), with
    the ideal FLOP ratio (dashed) and the ideal token ratio (dotted) of each in the same colour."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    series = sorted({(r["model"], r["G"]) for r in rows if f"{method}_speedup" in r})
    for i, (model, G) in enumerate(series):
        pts = sorted(
            (r["P"], r[f"{method}_speedup"], r["ideal_flop_ratio"], r["ideal_token_ratio"])
            for r in rows
            if r["model"] == model and r["G"] == G and f"{method}_speedup" in r
        )
        P = [p[0] for p in pts]
        label = f"G={G}" if len({m for m, _ in series}) == 1 else f"{model}, G={G}"
        ax.plot(P, [p[1] for p in pts], "o-", color=f"C{i}", label=f"{label}: measured")
        ax.plot(P, [p[2] for p in pts], "--", color=f"C{i}", alpha=0.7, label=f"{label}: ideal FLOPs")
        ax.plot(P, [p[3] for p in pts], ":", color=f"C{i}", alpha=0.7, label=f"{label}: ideal tokens")
    ax.set_xscale("log", base=2)
    ps = sorted({r["P"] for r in rows})
    ax.set_xticks(ps, [str(p) for p in ps])
    ax.set_xlabel("shared prompt length P (tokens)")
    ax.set_ylabel(f"tree training ({method}) speedup over dense")
    models = ", ".join(sorted({r["model"] for r in rows}))
    R = ", ".join(str(x) for x in sorted({r["R"] for r in rows}))
    m = machine()
    ax.set_title(
        f"{models} Llama, G completions of {R} tokens, forward + backward; {m['cpu']} CPU, {m['threads']} threads",
        fontsize=8,
    )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}", file=sys.stderr)


def isolated_rss(name: str, P: int, G: int, method: str, args) -> dict:
    """Run one method in a fresh process: its peak RSS is not hidden by memory an earlier method
    left in this process's allocator."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.tree_training",
        "--one",
        f"{name}:{P}:{G}:{method}",
        "--R",
        str(args.R),
        "--block-size",
        str(args.block_size),
        "--dense-tokens",
        str(args.dense_tokens),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one(spec: str, args) -> None:
    name, P, G, method = spec.split(":")
    P, G = int(P), int(G)
    model = _model(name, args)
    seqs, sf, coefs = grpo_batch(P, G, args.R, model.config.vocab_size)
    forest = PrefixForest.build(seqs, sf)
    import psutil

    before = psutil.Process().memory_info().rss
    if method == "dense":
        dense_step(model, seqs, sf, coefs, args.dense_tokens, grad=True)
    else:
        _executor(model, method, args).backward(forest, coefs)
    peak = peak_rss_bytes()
    print(json.dumps({"method": method, "rss_before_mb": before / 2**20, "peak_rss_mb": peak / 2**20}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny", help="comma list of: tiny, mini, small")
    ap.add_argument("--P", default="512", help="comma list of prompt lengths")
    ap.add_argument("--G", default="4", help="comma list of group sizes")
    ap.add_argument("--R", type=int, default=256, help="completion length")
    ap.add_argument("--groups", type=int, default=1, help="GRPO groups per step (each its own prompt)")
    ap.add_argument("--methods", default="dense,keep,replay,packed")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the model size's own)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per method, round robin; the median is kept")
    ap.add_argument("--block-size", type=int, default=512, help="replay block size")
    ap.add_argument("--dense-tokens", type=int, default=16384, help="tokens per dense micro-batch")
    ap.add_argument("--no-score", dest="score", action="store_false", help="skip the scoring comparison")
    ap.add_argument("--score-only", action="store_true", help="only the scoring comparison")
    ap.add_argument(
        "--skip", default="", help="semicolon list of model:P:G:method to skip, e.g. small:8192:8:dense"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the executor follows the model's device)")
    ap.add_argument(
        "--isolate", action="store_true", help="also measure each method's peak RSS in its own process"
    )
    ap.add_argument("--plot", default=None, help="write a PNG of keep's speedup against P (one line per G)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args.one, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = {tuple(s.split(":")) for s in args.skip.split(";") if s}
    rows = []
    for name in args.models.split(","):
        model = _model(name, args).to(args.device)
        # Warm-up (allocator, kernels, lazy imports), so the first timed method is not penalised.
        w_seqs, w_sf, w_coefs = grpo_batch(64, 2, 16, model.config.vocab_size)
        dense_step(model, w_seqs, w_sf, w_coefs, args.dense_tokens, grad=True)
        TreeExecutor(model).backward(PrefixForest.build(w_seqs, w_sf), w_coefs)
        model.zero_grad(set_to_none=True)
        for P in (int(x) for x in args.P.split(",")):
            for G in (int(x) for x in args.G.split(",")):
                methods = [m for m in args.methods.split(",") if (name, str(P), str(G), m) not in skip]
                row = run_config(model, name, P, G, args.R, methods, args)
                if args.isolate:
                    for m in methods:
                        iso = isolated_rss(name, P, G, m, args)
                        row[f"{m}_peak_rss_mb"] = iso["peak_rss_mb"]
                        row[f"{m}_rss_before_mb"] = iso["rss_before_mb"]
                rows.append(row)
    cols = [
        ("model", "{}"),
        ("groups", "{}"),
        ("P", "{}"),
        ("G", "{}"),
        ("ideal_token_ratio", "{:.2f}"),
        ("ideal_flop_ratio", "{:.2f}"),
        ("dense_s", "{:.2f}"),
        ("keep_s", "{:.2f}"),
        ("keep1_s", "{:.2f}"),
        ("keepdf_s", "{:.2f}"),
        ("replay_s", "{:.2f}"),
        ("packed_s", "{:.2f}"),
        ("keep_speedup", "{:.2f}"),
        ("keep_achieved_over_ideal", "{:.2f}"),
        ("keep_over_ideal_tokens", "{:.2f}"),
        ("keep_over_keep1", "{:.2f}"),
        ("keep_over_keepdf", "{:.2f}"),
        ("replay_speedup", "{:.2f}"),
        ("packed_speedup", "{:.2f}"),
        ("keep_over_packed", "{:.2f}"),
        ("dense_saved_mb", "{:.0f}"),
        ("keep_saved_mb", "{:.0f}"),
        ("replay_saved_mb", "{:.0f}"),
        ("packed_saved_mb", "{:.0f}"),
        ("dense_peak_rss_mb", "{:.0f}"),
        ("keep_peak_rss_mb", "{:.0f}"),
        ("replay_peak_rss_mb", "{:.0f}"),
        ("packed_peak_rss_mb", "{:.0f}"),
        ("score_speedup", "{:.2f}"),
        ("score_achieved_over_ideal_token", "{:.2f}"),
    ]
    print_table(rows, cols)
    if args.plot:
        plot(rows, args.plot)
    print(json.dumps({"benchmark": "tree_training", "machine": machine(), "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
