"""benchmarks/openrlhf_step.py keeps running (python -m benchmarks.openrlhf_step, from the repo root), tiny setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from forkrl.core.testing.ranks import clean_env

pytestmark = pytest.mark.slow  # each benchmark end to end

ROOT = Path(__file__).resolve().parents[2]


def test_openrlhf_step_benchmark_runs():
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.openrlhf_step",
        "--model",
        "tiny",
        "--P",
        "64",
        "--R",
        "16",
        "--steps",
        "1",
    ]
    # This process may hold a one-rank gloo group (the other tests): the benchmark starts its own.
    env = clean_env()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("| tree") for line in lines)
    res = json.loads(lines[-1])
    assert res["benchmark"] == "openrlhf_step" and res["param_agreement"] < 1e-4


def test_zero3_comm_benchmark_tree_moves_less_than_stock():
    """benchmarks/zero3_comm.py keeps running; the tree step's collectives per optimizer step are
    one model's worth each way, at most stock ZeRO-3's (which re-gathers per micro-batch)."""
    cmd = [sys.executable, "-m", "benchmarks.zero3_comm", "--model", "micro", "--P", "32", "--R", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=clean_env())
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    stock, tree = res["rows"]
    assert res["benchmark"] == "zero3_comm" and tree["path"] == "tree"
    assert abs(tree["over_model"] - 2.0) < 0.01 and tree["total_mib"] < stock["total_mib"]
    assert all(abs(a - b) < 1e-6 for a, b in res["losses"])


def test_openrlhf_balance_benchmark_runs():
    """benchmarks/openrlhf_balance.py on 2 gloo ranks, small shapes: rows move, the updates agree."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.openrlhf_balance",
        "--P-long",
        "96",
        "--P-short",
        "8",
        "--R",
        "8",
    ]
    out = subprocess.run(
        cmd + ["--reps", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT, env=clean_env()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("| auto") for line in lines)
    res = json.loads(lines[-1])
    assert res["benchmark"] == "openrlhf_balance" and res["param_agreement"] < 1e-4
    assert res["ranks"][0]["moved_rows"]["auto"] > 0
