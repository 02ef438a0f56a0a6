"""Long-context replay: GRPO on very long prompts, memory independent of the group size.

One prompt of P tokens and G responses of R tokens. forkrl runs the prompt without autograd in
blocks, keeps only its keys/values, trains the responses one at a time (adding their gradient into
the prompt's cache) and finally replays the prompt block by block in reverse with grad
(TreeExecutor(mode="replay", prompt_grad="exact")); "none" drops the prompt's gradient (the
truncated gradient of LongStraw, arXiv 2607.14952). Dense trains each prompt+response sequence
plainly (one sequence per micro-batch). Each method runs in its own process, so its peak RSS is its
own. Prints a table, then one line of JSON.

    .venv/bin/python -m benchmarks.long_context --P 4096,16384 --G 2,8                 # minutes
    .venv/bin/python -m benchmarks.long_context --P 16384,65536 --G 2,8 --methods exact,none
    .venv/bin/python -m benchmarks.long_context --find-max --budget-gib 16           # longest prompt that fits
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import machine
from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.executor import plan
from forkrl.core.testing import SavedBytes, peak_rss_bytes
from forkrl.core.testing.models import llama

REPO = Path(__file__).resolve().parents[1]  # the child process imports benchmarks from here

# SIZES' tiny with 2 layers and one key/value head: keys/values are small next to activations, as
# in real long-context models.
TINY = dict(num_hidden_layers=2, num_key_value_heads=1)


def make_model(vocab: int, max_pos: int):
    return llama("tiny", max_pos=max_pos, vocab_size=vocab, **TINY)


def batch(P: int, G: int, R: int, vocab: int):
    """One prompt ``[P]``, G responses ``[R]`` and their coefficients ``[R]`` (the prompt held once)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (P,), generator=g)
    responses = [torch.randint(0, vocab, (R,), generator=g) for _ in range(G)]
    coefs = [torch.randn(R, generator=g) / (G * R) for _ in range(G)]
    return prompt, responses, coefs


def run_one(method: str, P: int, G: int, R: int, block: int, vocab: int, split: bool = True) -> dict:
    """One method on one configuration, in this process (called in a child process).

    Both methods hold the prompt's token ids once: dense forms each prompt+response sequence when
    it trains it; forkrl forms all G to build its forest, which keeps the prompt once, and drops them.
    """
    model = make_model(vocab, P + R + 1)
    prompt, responses, coefs = batch(P, G, R, vocab)
    meter = SavedBytes()
    base_rss = _rss()
    t0 = time.perf_counter()
    with meter.measure():
        if method == "dense":
            total = G
            for k, (resp, c) in enumerate(zip(responses, coefs, strict=True)):
                progress(k, G)
                seq = torch.cat([prompt, resp])
                logits = model(input_ids=seq[None], logits_to_keep=R + 1).logits[0, :-1]
                lp = torch.log_softmax(logits.float(), -1).gather(-1, seq[P:, None])[:, 0]
                (lp * c).sum().backward()
                del seq, logits, lp
        else:
            forest = PrefixForest.build([torch.cat([prompt, r]) for r in responses], [P] * G)
            del prompt, responses
            ex = TreeExecutor(
                model, mode="replay", block_size=block, prompt_grad=method, split_attention=split
            )
            units, _ = plan(forest, block)
            inner = sum(1 for u in units if u.children)  # prompt blocks: forwarded twice by "exact"
            total = len(units) - inner + inner * (2 if method == "exact" else 1)
            forward, calls = ex.adapter.hidden, [0]  # one decoder forward per unit in a gradient pass

            def counted(*a, **k):
                progress(calls[0], total)
                calls[0] += 1
                return forward(*a, **k)

            ex.adapter.hidden = counted
            ex.backward(forest, coefs)
    progress(total, total)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    return {
        "method": method,
        "P": P,
        "G": G,
        "seconds": seconds,
        "saved_peak_mb": meter.peak / 2**20,
        "peak_rss_mb": peak / 2**20,
        "base_rss_mb": base_rss / 2**20,
    }


_last_report = [0.0]


def progress(done: int, total: int) -> None:
    """A progress line on stderr (at most one a second; the parent shows the child's stderr)."""
    now = time.perf_counter()
    if done < total and now - _last_report[0] < 1.0:
        return
    _last_report[0] = now
    end = "\n" if done >= total else ""
    print(
        f"\r    {done}/{total} forwards ({100 * done / max(total, 1):.0f}%)",
        end=end,
        file=sys.stderr,
        flush=True,
    )


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def in_child(method: str, P: int, G: int, args, limit_gib: float | None = None) -> dict | None:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.long_context",
        "--one",
        f"{method}:{P}:{G}",
        "--R",
        str(args.R),
        "--block-size",
        str(args.block_size),
    ]
    if not args.split:
        cmd.append("--no-split")
    if limit_gib:
        # An address-space limit makes an over-budget run fail fast instead of swapping.
        cmd = ["bash", "-c", f"ulimit -v {int(limit_gib * 2**20)}; exec " + " ".join(cmd)]
    env = dict(os.environ)
    if args.mmap:
        # glibc keeps freed heap memory and fragments it, so peak RSS creeps up with every branch
        # although live memory does not (measured: +5% from G=2 to G=8 at P=32k); large blocks
        # from mmap go back to the OS on free. Applied to every method alike.
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    print(f"  {method} P={P} G={G}:", file=sys.stderr, flush=True)
    # stderr: the child's progress
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def find_max(method: str, args) -> int:
    """Doubling then bisection on P (multiples of 1024) under an address-space budget."""
    lo, hi, P = 0, None, 4096
    while hi is None:
        print(f"  {method}: trying P={P}", file=sys.stderr, flush=True)
        if in_child(method, P, args.G_max, args, args.budget_gib):
            lo, P = P, P * 2
        else:
            hi = P
        if P > args.max_search:
            return lo
    while hi - lo > max(1024, lo // 8):
        mid = (lo + hi) // 2 // 1024 * 1024
        print(f"  {method}: trying P={mid}", file=sys.stderr, flush=True)
        if in_child(method, mid, args.G_max, args, args.budget_gib):
            lo = mid
        else:
            hi = mid
    return lo


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--P", default="4096,16384")
    ap.add_argument("--G", default="2,8")
    ap.add_argument("--R", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--methods", default="dense,exact,none")
    ap.add_argument("--find-max", action="store_true", help="search the longest prompt within --budget-gib")
    ap.add_argument("--budget-gib", type=float, default=16.0)
    ap.add_argument("--G-max", dest="G_max", type=int, default=8, help="group size for --find-max")
    ap.add_argument("--max-search", type=int, default=1 << 21)
    ap.add_argument(
        "--no-mmap",
        dest="mmap",
        action="store_false",
        help="leave glibc's malloc thresholds alone (peak RSS then includes heap fragmentation)",
    )
    ap.add_argument(
        "--no-split",
        dest="split",
        action="store_false",
        help="TreeExecutor(split_attention=False): the model's masked sdpa over the prompt cache",
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


def run_find_max(methods: list[str], args) -> list[dict]:
    """The longest prompt within the budget, per method; prints its table."""
    rows = []
    for m in methods:
        rows.append({"method": m, "max_P": find_max(m, args), "G": args.G_max, "budget_gib": args.budget_gib})
    print("| method | G | longest prompt in budget |\n|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['G']} | {r['max_P']} |")
    return rows


def run_grid(methods: list[str], args) -> list[dict]:
    """Every method on every (P, G), each in its own process; a failed run is a row marked failed."""
    rows = []
    for P in (int(x) for x in args.P.split(",")):
        for G in (int(x) for x in args.G.split(",")):
            for m in methods:
                r = in_child(m, P, G, args)
                if r is None:
                    r = {"method": m, "P": P, "G": G, "failed": True}
                print(f"  {m} P={P} G={G}: {r}", file=sys.stderr, flush=True)
                rows.append(r)
    return rows


def print_grid(rows: list[dict]) -> None:
    print("| P | G | method | seconds | peak saved MB | peak RSS MB |\n|---|---|---|---|---|---|")
    for r in rows:
        if r.get("failed"):
            print(f"| {r['P']} | {r['G']} | {r['method']} | failed | - | - |")
        else:
            print(
                f"| {r['P']} | {r['G']} | {r['method']} | {r['seconds']:.1f} | {r['saved_peak_mb']:.1f} | "
                f"{r['peak_rss_mb']:.0f} |"
            )


def print_fits(fits: list[dict], budget_gib: float) -> None:
    print(
        f"\nPeak RSS = intercept + slope x P (least squares over the P above), and the longest prompt "
        f"that would fit in {budget_gib:g} GiB by that line (extrapolated, not run):\n"
    )
    print(
        "| method | G | KiB per prompt token | intercept MiB | max residual MiB | longest prompt in budget |"
    )
    print("|---|---|---|---|---|---|")
    for f in fits:
        print(
            f"| {f['method']} | {f['G']} | {f['kib_per_token']:.3f} | {f['intercept_mib']:.0f} | "
            f"{f['max_residual_mib']:.2f} | {f['max_P_extrapolated'] / 1e6:.2f}M |"
        )


def main() -> None:
    args = parse_args()
    if args.one:
        method, P, G = args.one.split(":")
        print(json.dumps(run_one(method, int(P), int(G), args.R, args.block_size, args.vocab, args.split)))
        return

    methods = args.methods.split(",")
    if args.find_max:
        rows = run_find_max(methods, args)
    else:
        rows = run_grid(methods, args)
        print_grid(rows)
        fits = fit_memory(rows, args.budget_gib)
        if fits:
            print_fits(fits, args.budget_gib)
            rows = rows + fits
    print(json.dumps({"benchmark": "long_context", "machine": machine(), "args": vars(args), "rows": rows}))


def fit_memory(rows: list[dict], budget_gib: float) -> list[dict]:
    """Per (method, G) with at least two prompt lengths: the straight line through peak RSS over P,
    and the P at which it reaches the budget."""
    fits = []
    keys = sorted({(r["method"], r["G"]) for r in rows if not r.get("failed")}, key=str)
    for method, G in keys:
        pts = sorted(
            (r["P"], r["peak_rss_mb"])
            for r in rows
            if (r["method"], r["G"]) == (method, G) and not r.get("failed")
        )
        if len({p for p, _ in pts}) < 2:
            continue
        P = torch.tensor([p for p, _ in pts], dtype=torch.float64)
        M = torch.tensor([m for _, m in pts], dtype=torch.float64)
        A = torch.stack([P, torch.ones_like(P)], 1)
        slope, intercept = torch.linalg.lstsq(A, M[:, None]).solution[:, 0].tolist()
        fits.append(
            {
                "method": method,
                "G": G,
                "kib_per_token": slope * 1024,
                "intercept_mib": intercept,
                "max_residual_mib": float(
                    (A @ torch.tensor([slope, intercept], dtype=torch.float64) - M).abs().max()
                ),
                "max_P_extrapolated": int((budget_gib * 1024 - intercept) / slope),
            }
        )
    return fits


if __name__ == "__main__":
    main()
