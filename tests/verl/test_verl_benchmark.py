"""benchmarks/verl_step.py keeps running (python -m benchmarks.verl_step, from the repo root), tiny setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from forkrl.core.testing.ranks import clean_env

pytestmark = pytest.mark.slow  # each benchmark end to end

ROOT = Path(__file__).resolve().parents[2]


def test_verl_step_benchmark_runs():
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.verl_step",
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
    assert res["benchmark"] == "verl_step" and res["param_agreement"] < 1e-4


def test_verl_balance_benchmark_runs():
    """benchmarks/verl_balance.py on 2 gloo ranks, small shapes: rows move, the updates agree."""
    cmd = [sys.executable, "-m", "benchmarks.verl_balance", "--P-long", "96", "--P-short", "8", "--R", "8"]
    out = subprocess.run(
        cmd + ["--reps", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT, env=clean_env()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("| veRL length / auto") for line in lines)
    res = json.loads(lines[-1])
    assert res["benchmark"] == "verl_balance" and res["param_agreement"] < 1e-4
    assert res["ranks"][0]["moved_rows"]["veRL length / auto"] > 0
