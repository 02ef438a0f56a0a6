"""``python -m forkrl estimate``'s predicted speedup against ``benchmarks.tree_training``'s measured one.

For each shape (P, G, R) a dataset of prompts of P token ids is written (``--groups`` groups a step), ``forkrl estimate``
predicts the keep mode's training speedup over stock from a fit on its own small calibration
shapes (never the shape checked), then ``benchmarks.tree_training`` measures dense against keep
on that shape, in this process, one after the other, on the same number of threads (``--threads``:
the estimate times on one by default). With ``--runs N``, the first shape is estimated N more
times: how far identical estimates spread. Prints a table, then one line of JSON; exits 1 when a
prediction is off by more than ``--tolerance``.

    .venv/bin/python -m benchmarks.estimate_check                       # three shapes, about two minutes
    .venv/bin/python -m benchmarks.estimate_check --runs 6              # and six estimates of the first
    .venv/bin/python -m benchmarks.estimate_check --threads 0           # all cores (a machine nothing else uses)
    .venv/bin/python -m benchmarks.estimate_check --groups 8 --shapes 256:4:32   # steps of 8 groups
    .venv/bin/python -m benchmarks.estimate_check --shapes 512:4:256,2048:8:128 --model small
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import machine, print_table
from benchmarks.tree_training import run_config
from forkrl.__main__ import main as forkrl_main
from forkrl.core.testing.models import llama

DEFAULT_SHAPES = "256:8:128,1024:4:64,512:16:32"


def predicted(
    model, P: int, G: int, R: int, prompts: int, folder: Path, threads: int, groups: int = 1
) -> dict:
    """``forkrl estimate --json`` on ``prompts`` random P-token prompts, ``groups`` a step."""
    model.config.save_pretrained(folder / "model")
    g = torch.Generator().manual_seed(P * 31 + G)
    with (folder / "prompts.jsonl").open("w") as f:
        for _ in range(prompts):
            ids = torch.randint(0, model.config.vocab_size, (P,), generator=g).tolist()
            f.write(json.dumps({"prompt_ids": ids}) + "\n")
    out = folder / "estimate.json"
    argv = ["estimate", "--model", str(folder / "model"), "--dataset", str(folder / "prompts.jsonl")]
    argv += [
        "-G",
        str(G),
        "-R",
        str(R),
        "--prompts-per-step",
        str(groups),
        "--price",
        "fit",
        "--no-gradient-checkpointing",
    ]
    argv += ["--score-passes", "0", "--timing-threads", str(threads), "--json"]
    stdout = sys.stdout
    with out.open("w") as sys.stdout:
        forkrl_main(argv)
    sys.stdout = stdout
    return json.loads(out.read_text())


def _stability(model, args) -> dict:
    """``args.runs`` identical estimates of the first shape: keep's lowest and highest prediction."""
    P, G, R = (int(x) for x in args.shapes.split(",")[0].split(":"))
    speedups = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            est = predicted(model, P, G, R, args.prompts, Path(tmp), args.threads, args.groups)
            speedups.append(est["modes"]["keep"])
    low = min(m["train_speedup"] for m in speedups)
    high = max(m["train_speedup"] for m in speedups)
    print(
        f"\n{args.runs} estimates of P={P} G={G} R={R}: keep {low:.2f}x to {high:.2f}x "
        f"(highest / lowest {high / low:.3f}); each run's own spread over its repeats: "
        + ", ".join(f"{lo:.2f}-{hi:.2f}x" for lo, hi in (m["train_speedup_range"] for m in speedups))
    )
    return {"P": P, "G": G, "R": R, "speedups": [m["train_speedup"] for m in speedups], "ratio": high / low}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a core.testing.models size: micro, tiny, mini, small")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of P:G:R")
    ap.add_argument(
        "--prompts", type=int, default=4, help="prompts in each shape's dataset (at least --groups)"
    )
    ap.add_argument("--groups", type=int, default=1, help="GRPO groups per step, estimated and measured")
    ap.add_argument("--repeat", type=int, default=3, help="measured runs per method (median)")
    ap.add_argument("--tolerance", type=float, default=0.25, help="largest relative error accepted")
    ap.add_argument("--runs", type=int, default=0, help="more estimates of the first shape (their spread)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of both the estimate's timings (--timing-threads) and the measured steps "
        "(0: torch's default)",
    )
    args = ap.parse_args()
    args.prompts = max(args.prompts, args.groups)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = llama(args.model)
    bench = argparse.Namespace(
        score_only=False,
        score=False,
        repeat=args.repeat,
        dense_tokens=16384,
        block_size=512,
        groups=args.groups,
    )
    # Warm-up (allocator, kernels, lazy imports), so the first timed method is not penalised.
    run_config(
        model, args.model, 64, 2, 16, ["dense", "keep"], argparse.Namespace(**{**vars(bench), "repeat": 1})
    )
    rows = []
    for spec in args.shapes.split(","):
        P, G, R = (int(x) for x in spec.split(":"))
        with tempfile.TemporaryDirectory() as tmp:
            est = predicted(model, P, G, R, args.prompts, Path(tmp), args.threads, args.groups)
        row = run_config(model, args.model, P, G, R, ["dense", "keep"], bench)
        row["predicted_speedup"] = est["modes"]["keep"]["train_speedup"]
        row["measured_speedup"] = row["keep_speedup"]
        row["error"] = row["predicted_speedup"] / row["measured_speedup"] - 1
        row["predicted_compression"] = est["compression"]
        rows.append(row)
    print_table(
        rows,
        [
            ("P", "{}"),
            ("G", "{}"),
            ("R", "{}"),
            ("ideal_token_ratio", "{:.2f}"),
            ("predicted_compression", "{:.2f}"),
            ("dense_s", "{:.3f}"),
            ("keep_s", "{:.3f}"),
            ("measured_speedup", "{:.2f}"),
            ("predicted_speedup", "{:.2f}"),
            ("error", "{:+.1%}"),
        ],
    )
    stability = _stability(model, args) if args.runs else None
    worst = max(abs(r["error"]) for r in rows)
    print(
        json.dumps(
            {
                "benchmark": "estimate_check",
                "machine": machine(),
                "args": vars(args),
                "worst_error": worst,
                "rows": rows,
                "stability": stability,
            }
        )
    )
    sys.exit(0 if worst <= args.tolerance else 1)


if __name__ == "__main__":
    main()
