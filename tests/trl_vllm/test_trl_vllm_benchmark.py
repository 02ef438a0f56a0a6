"""``benchmarks/trl_vllm_run.py`` runs end to end (a tiny policy, two modes, two steps of 2 prompts x 4
completions of at most 16 tokens) and prints its table and a last line of JSON whose rows carry the
step, rollout and speculative figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trl_vllm.ports import free_port_env

pytest.importorskip("vllm")
pytest.importorskip("trl")

pytestmark = pytest.mark.slow  # the benchmark end to end

ROOT = Path(__file__).resolve().parents[2]


def test_the_trl_vllm_benchmark_runs(tmp_path):
    proc = subprocess.run(
        [
            sys.executable, "-m", "benchmarks.trl_vllm_run", "--model", "tiny", "--train-seconds", "5",
            "--steps", "2", "--modes", "stock,always", "--max-new-tokens", "16", "--prompts", "2",
            "--dir", str(tmp_path),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        # vLLM's CPU-CI switch: the engines run Dynamo's trace eagerly rather than compile it with
        # inductor (tests/trl_vllm/colocate_run.py's speculative run compiles forkrl's drafter)
        env={**free_port_env(), "VLLM_CPU_CI_ENV": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {row["mode"]: row for row in json.loads(proc.stdout.strip().splitlines()[-1])["rows"]}
    assert set(rows) == {"stock", "always"}
    for row in rows.values():
        assert row["steps"] == 1 and 0 < row["generate_s"] < row["step_s"]
    assert 0 < rows["always"]["spec/acceptance"] <= 1 and "spec/acceptance" not in rows["stock"]
