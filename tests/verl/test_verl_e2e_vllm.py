"""veRL end to end on its own vLLM rollout (veRL's vLLM server on vLLM's CPU build): stock veRL, and the
tree in long-context replay with forkrl's drafter, launched as test_verl_e2e.py launches its
runs, with the same checks; a file of its own so that scripts/test.sh runs it beside that one."""

from __future__ import annotations

import pytest

from forkrl.plugins.verl import testing as harness
from forkrl.plugins.verl.testing_e2e import build_inputs, main_ppo
from tests.verl.e2e_checks import check_run, check_vllm_rollouts

pytestmark = pytest.mark.slow  # veRL's main_ppo end to end through Ray


@pytest.fixture(scope="module")
def vllm_inputs(tmp_path_factory) -> dict:
    """:func:`build_inputs` with a model vLLM's CPU build serves and forkrl's int4 drafter tiles."""
    pytest.importorskip("vllm")
    return build_inputs(tmp_path_factory.mktemp("verl-e2e-vllm"), shape=harness.VLLM_SHAPE)


def test_stock_verl_runs_through_the_same_harness_on_vllm(vllm_inputs, tmp_path):
    """Stock veRL with its own vLLM rollout (vLLMReplica, hybrid mode) on vLLM's CPU build."""
    log = main_ppo(vllm_inputs, tmp_path, None, rollout="vllm")
    check_vllm_rollouts(check_run(vllm_inputs, tmp_path, log, tree=False))


def test_the_long_context_tree_and_speculative_run_trains_on_vllm(vllm_inputs, tmp_path):
    """forkrl_tree_speculative with long-context replay: the tree in replay (each prompt without
    autograd, its cache kept, the responses replayed into it) in the actor, forkrl's int4 drafter in
    veRL's vLLM engine, re-synced by forkrl's vLLM plugin after every weight update veRL sends (its
    shared-memory bucketed transfer, ending in the engine's ``load_weights``). One run for both: the
    actor's mode and the engine's drafter are independent; test_verl_e2e.py runs forkrl_tree (the
    tree's own replay, veRL's checkpointing being on) on the Hugging Face rollout."""
    replay = "actor_rollout_ref.actor.forkrl.long_context_replay=true"
    log = main_ppo(vllm_inputs, tmp_path, "forkrl_tree_speculative", replay, rollout="vllm")
    logged = check_run(vllm_inputs, tmp_path, log, tree=True)
    assert all(m["data"]["actor/tree/mode"] == 1 for m in logged)  # replay
    assert "long_context_replay=True" in log  # the actor's config, printed as the plugin starts
    check_vllm_rollouts(logged)
    assert "forkrl_int4_g128" in log  # vLLM's engine config, printed as it starts
