"""veRL end to end as users launch it: ``python -m verl.trainer.main_ppo`` with forkrl's YAML.

veRL's own entry point, TaskRunner, Ray workers, TransferQueue, agent loop, reward loop, weight sync
and checkpointing run a few GRPO steps on a tiny model, launched through forkrl's CPU smoke run
(``python -m forkrl.plugins.verl.cpu_run``: a CPU platform loaded by veRL's own
``VERL_USE_EXTERNAL_MODULES`` hook, and veRL's own vLLM rollout on vLLM's CPU build, or for the tree
run and its resume pair the Hugging Face rollout with a recorder, :mod:`forkrl.plugins.verl.testing_host`).
Each run must exit 0, change the actor's parameters (its saved checkpoint against the initial
model) and, with forkrl, log ``tree/*`` in veRL's own metrics (its file logger); stock veRL runs
through the same harness and logs none. On vLLM, veRL's own comparison of the rollout's sampling
probabilities with the actor's shows that its weight sync reached the engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forkrl.plugins.verl import testing as harness
from forkrl.plugins.verl.testing_e2e import STEPS, build_inputs, main_ppo, metrics, saved_actor

pytestmark = pytest.mark.slow  # veRL's main_ppo end to end through Ray


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    return build_inputs(tmp_path_factory.mktemp("verl-e2e"))


def changed_parameters(inputs: dict, out: Path) -> float:
    """Largest change of any actor parameter: the step-``STEPS`` checkpoint against the initial model."""
    from transformers import AutoModelForCausalLM

    saved = saved_actor(out)
    initial = AutoModelForCausalLM.from_pretrained(inputs["model"]).state_dict()
    assert set(saved) == set(initial)
    return max((saved[k] - initial[k].float()).abs().max().item() for k in initial)


def check_run(inputs: dict, out: Path, log: str, tree: bool) -> list[dict]:
    """The run's own logs and checkpoint: every step logged, the actor trained, tree metrics iff ``tree``."""
    logged = metrics(out)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert changed_parameters(inputs, out) > 1e-4
    for m in logged:
        data = m["data"]
        assert data["critic/score/mean"] >= 0  # the reward ran
        tree_keys = [k for k in data if k.startswith("actor/tree/")]
        if tree:  # veRL prefixes the actor's metrics with actor/
            assert data["actor/tree/compression"] > 1.5, data["actor/tree/compression"]
            assert data["actor/tree/dense_tokens"] > data["actor/tree/unique_tokens"] > 0
        else:
            assert not tree_keys, tree_keys
    assert ("forkrl: veRL plugin active" in log) == tree
    return logged


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


@pytest.fixture(scope="module")
def vllm_inputs(tmp_path_factory) -> dict:
    """:func:`build_inputs` with a model vLLM's CPU build serves and forkrl's int4 drafter tiles."""
    pytest.importorskip("vllm")
    return build_inputs(tmp_path_factory.mktemp("verl-e2e-vllm"), shape=harness.VLLM_SHAPE)


def check_vllm_rollouts(logged: list[dict]) -> None:
    """veRL compares its rollout's sampling probabilities with the actor's: the engine starts from
    dummy weights (veRL's default load format), so they agree only if veRL's weight sync reached
    it (measured: about 5e-5; two different random models differ by about 4e-3)."""
    for m in logged:
        assert m["data"]["training/rollout_probs_diff_mean"] < 1e-3, m["data"][
            "training/rollout_probs_diff_mean"
        ]


def test_stock_verl_runs_through_the_same_harness_on_vllm(vllm_inputs, tmp_path):
    """Stock veRL with its own vLLM rollout (vLLMReplica, hybrid mode) on vLLM's CPU build."""
    log = main_ppo(vllm_inputs, tmp_path, None, rollout="vllm")
    check_vllm_rollouts(check_run(vllm_inputs, tmp_path, log, tree=False))


def test_the_long_context_run_trains_in_replay_on_vllm(vllm_inputs, tmp_path):
    log = main_ppo(vllm_inputs, tmp_path, "forkrl_long_context", rollout="vllm")
    logged = check_run(vllm_inputs, tmp_path, log, tree=True)
    assert all(m["data"]["actor/tree/mode"] == 1 for m in logged)
    check_vllm_rollouts(logged)


def test_the_tree_and_speculative_run_trains_on_vllm(vllm_inputs, tmp_path):
    """forkrl_tree_speculative: the tree in the actor, forkrl's int4 drafter in veRL's vLLM engine,
    re-synced by forkrl's vLLM plugin after every weight update veRL sends (its shared-memory
    bucketed transfer, ending in the engine's ``load_weights``)."""
    log = main_ppo(vllm_inputs, tmp_path, "forkrl_tree_speculative", rollout="vllm")
    check_vllm_rollouts(check_run(vllm_inputs, tmp_path, log, tree=True))
    assert "forkrl_int4_g128" in log  # vLLM's engine config, printed as it starts
