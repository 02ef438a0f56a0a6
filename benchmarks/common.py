"""Shared measurement tools for the benchmarks: machine info, tables, timing.

Models, sizes and FLOP counts are in :mod:`forkrl.core.testing.models`; memory meters in
:mod:`forkrl.core.testing`.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is in the dev extra
    psutil = None


REPO = Path(__file__).resolve().parents[1]


def run_ranks(module: str, env_flag: str, ranks: int = 2, timeout: float = 3600) -> list[dict]:
    """Run ``python -m module`` (this process's command line) on ``ranks`` gloo ranks, ``env_flag``
    set so the module runs its rank part; every rank's ``RESULT {json}`` record, in rank order.

    Raises:
        SystemExit: when not every rank reported (with the end of the ranks' output).
    """
    from forkrl.core.testing.ranks import torchrun

    proc = torchrun(
        module, *sys.argv[1:], nproc=ranks, timeout=timeout, cwd=REPO, module=True, **{env_flag: "1"}
    )
    results = [
        json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")
    ]
    if len(results) != ranks:
        raise SystemExit(f"{module}: expected {ranks} rank results, got:\n{proc.stdout[-3000:]}")
    return results


def machine() -> dict:
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if psutil is not None:
        info["cores"] = psutil.cpu_count(logical=True)
        info["ram_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    return info


def print_table(rows: list[dict], cols: list[tuple[str, str]]) -> None:
    """Markdown table of the (key, format) columns that some row has; missing cells print '-'."""
    cols = [(c, f) for c, f in cols if any(c in r for r in rows)]
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f.format(r[c]) if c in r else "-" for c, f in cols) + " |")


def timed(fn):
    """(seconds, result) of ``fn()``; waits for queued GPU work on both sides of the clock."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out
