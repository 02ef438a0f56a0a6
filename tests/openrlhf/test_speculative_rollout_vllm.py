"""``benchmarks.speculative_rollout --engine vllm`` runs through real vLLM engines on this CPU (a smoke
run: a barely trained tiny policy, so its figures say nothing about speed; the measured ones are in
``benchmarks/results/speculative_rollout.md``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow  # the benchmark through vLLM engines

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_serves_every_method_through_vllm(tmp_path):
    cmd = [
        sys.executable, "-m", "benchmarks.speculative_rollout", "--engine", "vllm", "--model", "tiny",
        "--train-seconds", "5", "--batch", "4", "--workloads", "short,one-long", "--repeats", "1",
        "--calib-batches", "1,2,4", "--max-new-tokens", "32", "--short-max-new-tokens", "16",
        "--vllm-dir", str(tmp_path / "policy"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {(r["workload"], r["method"]): r for r in summary["results"]}
    assert set(rows) == {
        (w, m) for w in ("short", "one-long") for m in ("plain", "plain_dense", "auto", "always", "ngram")
    }
    for (_, method), row in rows.items():
        assert row["tokens"] > 0 and row["wall_s"] > 0 and row["time_vs_plain"] > 0
        if method == "always":  # forkrl's drafter drafted, vLLM counted it
            assert row["draft_len"] == 4.0 and 0.0 <= row["acceptance"] <= 1.0
        if method.startswith("plain"):
            assert "acceptance" not in row
    assert all("schedule" in rows[(w, "auto")] for w in ("short", "one-long"))
