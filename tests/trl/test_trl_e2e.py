"""TRL end to end as users launch it: ``accelerate launch`` with 2 processes (gloo on the CPU),
TRL's own generation and checkpointing, forkrl on and off.

The tree run must finish, change the parameters and log ``tree/*`` in TRL's own
``trainer_state.json``; resumed from its step-2 checkpoint it must reach the uninterrupted run's
parameters at step 4 (TRL restores the optimizer, scheduler, RNG and data position; forkrl keeps
no state that changes the update); stock TRL runs through the same harness and logs no ``tree/*``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forkrl.core.testing.ranks import clean_env

pytest.importorskip("trl")

from .trl_helpers import save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow  # TRL's own launchers end to end

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("trl_e2e_train.py")


def _launch(model: str, out: Path, mode: str, steps: int, resume: Path | None = None) -> dict:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT)]
    cmd += [model, str(out), mode, str(steps), *([str(resume)] if resume else [])]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=clean_env(OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = torch.load(out / "final.pt")
    assert saved["world"] == (2, "DistributedType.MULTI_CPU"), saved["world"]  # two gloo processes
    return saved["params"]


def _logs(checkpoint: Path) -> list[dict]:
    return json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]


def _max_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("e2e-model"))


@pytest.fixture(scope="module")
def tree_run(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("tree")
    return out, _launch(model, out, "tree", 4)


def test_the_tree_run_trains_and_logs_in_trls_own_state(model, tree_run):
    out, final = tree_run
    from transformers import AutoModelForCausalLM

    init = dict(AutoModelForCausalLM.from_pretrained(model).named_parameters())
    assert _max_diff(final, {n: p.detach() for n, p in init.items()}) > 1e-3  # SGD moved every run
    logs = [h for h in _logs(out / "checkpoint-4") if "loss" in h]
    assert len(logs) == 4
    for h in logs:
        assert h["tree/compression"] > 1.0 and h["tree/unique_tokens"] > 0
        # TRL's default gradient checkpointing is on: the tree replays (mode 1), as documented
        assert h["tree/mode"] == 1


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(model, tree_run, tmp_path):
    out, final = tree_run
    resumed = _launch(model, out, "tree", 4, resume=out / "checkpoint-2")
    assert _max_diff(resumed, final) == 0.0


def test_stock_trl_runs_through_the_same_harness(model, tmp_path):
    _launch(model, tmp_path, "stock", 2)
    logs = [h for h in _logs(tmp_path / "checkpoint-2") if "loss" in h]
    assert len(logs) == 2 and not any(k.startswith("tree/") for h in logs for k in h)
