"""veRL end to end as users launch it: ``python -m verl.trainer.main_ppo`` with forkrl's YAML.

veRL's own entry point, TaskRunner, Ray workers, TransferQueue, agent loop, reward loop, weight sync
and checkpointing run a few GRPO steps on a tiny model, launched through forkrl's CPU smoke run
(``python -m forkrl.plugins.verl.cpu_run``: a CPU platform loaded by veRL's own
``VERL_USE_EXTERNAL_MODULES`` hook, and veRL's own vLLM rollout on vLLM's CPU build, in
test_verl_e2e_vllm.py, or here, for the tree run and its resume pair, the Hugging Face rollout with
a recorder, :mod:`forkrl.plugins.verl.testing_host`).
Each run must exit 0, change the actor's parameters (its saved checkpoint against the initial
model) and, with forkrl, log ``tree/*`` in veRL's own metrics (its file logger); stock veRL runs
through the same harness and logs none. On vLLM, veRL's own comparison of the rollout's sampling
probabilities with the actor's shows that its weight sync reached the engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forkrl.plugins.verl.testing_e2e import STEPS, build_inputs, main_ppo, metrics, saved_actor
from tests.verl.e2e_checks import check_run

pytestmark = pytest.mark.slow  # veRL's main_ppo end to end through Ray


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    return build_inputs(tmp_path_factory.mktemp("verl-e2e"))


@pytest.fixture(scope="module")
def tree_run(inputs, tmp_path_factory) -> tuple[Path, str]:
    """On the Hugging Face rollout (the stand-in), as its resume pair needs: see forkrl.core.testing.launcher."""
    out = tmp_path_factory.mktemp("tree")
    return out, main_ppo(inputs, out, "forkrl_tree")


def test_the_tree_run_trains_and_logs_tree_metrics(inputs, tree_run):
    out, log = tree_run
    logged = check_run(inputs, out, log, tree=True)
    # veRL's gradient checkpointing is on in its default config: tree_mode auto replays
    assert all(m["data"]["actor/tree/mode"] == 1 for m in logged)


def test_resuming_from_a_checkpoint_equals_the_uninterrupted_run(inputs, tree_run, tmp_path):
    """veRL's own resume (``resume_mode=resume_path``) from the tree run's step-1 checkpoint reaches
    its step-2 parameters: veRL restores the optimizer, scheduler and data position, and forkrl
    keeps no state that changes the update (the rollout stand-in samples by prompt and position)."""
    out, _ = tree_run
    main_ppo(
        inputs,
        tmp_path,
        "forkrl_tree",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={out / 'ckpt' / 'global_step_1'}",
    )
    assert [m["step"] for m in metrics(tmp_path)] == [STEPS]  # only the step after the checkpoint ran
    resumed, uninterrupted, at_checkpoint = saved_actor(tmp_path), saved_actor(out), saved_actor(out, 1)
    assert (
        max((uninterrupted[k] - at_checkpoint[k]).abs().max().item() for k in resumed) > 1e-4
    )  # step 2 moved them
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)  # bitwise
