"""TRL's two ways to start a vLLM engine with forkrl's drafter refuse it before the engine starts
where forkrl's vLLM plugin does not install in the vLLM of this environment (simulated: a release
that moved the model runner's module)."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("trl")

from forkrl.plugins import trl as ftrl  # noqa: E402
from forkrl.plugins.trl import vllm_serve  # noqa: E402

MESSAGE = r"vLLM plugin, which does not install in vLLM 0\.31\.0.*\(ModuleNotFoundError: .*gpu_model_runner"


@pytest.fixture
def moved_runner(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", None)


def test_the_colocated_config_refuses_the_drafter(tmp_path, moved_runner):
    kwargs = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", use_vllm=True)
    with pytest.raises(ValueError, match=MESSAGE + r".*set speculative_rollout=False, or use_vllm=False"):
        ftrl.GRPOConfig(**kwargs, vllm_mode="colocate", speculative_rollout=True, speculative_policy="always")
    # server mode: the trainer starts no engine; the server checks its own
    ftrl.GRPOConfig(**kwargs, vllm_mode="server", speculative_rollout=True, speculative_policy="always")


def test_the_server_refuses_the_drafter(moved_runner):
    with pytest.raises(
        SystemExit, match=r"vllm_serve: error: .*" + MESSAGE + r".*run `trl vllm-serve` directly"
    ):
        vllm_serve.server_command(["--model", "org/policy", "--forkrl.speculative_draft_len", "4"])
