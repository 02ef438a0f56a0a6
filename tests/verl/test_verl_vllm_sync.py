"""After veRL's own weight sync into a real vLLM engine on this CPU (:mod:`tests.verl.vllm_sync_run`),
forkrl's drafter is bitwise forkrl's quantization of the new weights, and the engine drafts and
accepts exactly what an engine started from them does; without forkrl's mirror it does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.verl.vllm_sync_run", str(out), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def synced(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("synced"))


def test_verls_sync_resyncs_forkrls_drafter(synced):
    r = synced
    assert all(r["drafter_matches_w1"].values())
    assert r["greedy1"] == r["fresh1"] != r["greedy0"]
    assert r["counts1"] == r["fresh1_counts"] and r["counts1"]["accepted"] > 0


def test_without_the_mirror_the_drafter_is_stale_after_verls_sync(synced, tmp_path):
    """Against the engine started from W1 in the run above (``--no-mirror`` starts none)."""
    r = _run(tmp_path, "--no-mirror")
    assert not all(r["drafter_matches_w1"].values())
    assert r["counts1"] != synced["fresh1_counts"]
