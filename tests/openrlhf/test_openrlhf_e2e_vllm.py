"""OpenRLHF end to end on its own vLLM engines (vLLM's CPU build): stock OpenRLHF and forkrl's tree with
its self-speculative rollout, launched and checked as test_openrlhf_e2e.py's runs are; a file of its
own so that scripts/test.sh runs it beside that one."""

from __future__ import annotations

import pytest

from forkrl.plugins.openrlhf.testing_e2e import launch as _launch
from forkrl.plugins.openrlhf.testing_e2e import scalars as _scalars
from tests.openrlhf.e2e_checks import STEPS, assert_trained, build_data, vllm_loads

pytestmark = pytest.mark.slow  # OpenRLHF's launcher end to end through Ray


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    return build_data(tmp_path_factory.mktemp("openrlhf-e2e"))


def test_stock_openrlhf_runs_through_the_same_harness_on_vllm(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("stock")
    run = _launch("openrlhf.cli.train_ppo_ray", data, out)
    assert_trained(data, run)
    scalars = _scalars(out / "tb")
    assert sorted(scalars["train/policy_loss"]) == list(range(1, STEPS + 1))
    assert scalars["train/kl"][STEPS] > 0.0
    assert not [tag for tag in scalars if "tree/" in tag or "spec/" in tag]
    assert "'tree/" not in run["log"]  # nor in the console's step summaries
    assert vllm_loads(run["log"]) == [15] * STEPS  # every parameter of the engine, after every step


def test_the_tree_and_speculative_run_trains_on_vllm_and_logs_spec_metrics(data, tmp_path_factory):
    """forkrl's tree and its self-speculative rollout through OpenRLHF's vLLM engine: the drafter is
    forkrl's int4 quantization of the policy, re-quantized after every weight sync."""
    out = tmp_path_factory.mktemp("speculative")
    flags = ["--forkrl.tree_packing", "--forkrl.speculative_rollout", "--forkrl.speculative_draft_len", "3"]
    flags += ["--forkrl.speculative_group_size", "32"]
    run = _launch("forkrl.plugins.openrlhf.train_ppo_ray", {**data, "model": data["peaked"]}, out, *flags)
    assert_trained({**data, "model": data["peaked"]}, run)
    scalars = _scalars(out / "tb")
    assert sorted(scalars["train/tree/compression"]) == list(range(1, STEPS + 1))
    spec = {tag: steps for tag, steps in scalars.items() if tag.startswith("train/spec/")}
    assert {"train/spec/acceptance", "train/spec/draft_len", "train/spec/mean_accepted_length"} <= spec.keys()
    assert all(sorted(steps) == list(range(1, STEPS + 1)) for steps in spec.values())
    assert set(spec["train/spec/draft_len"].values()) == {3.0}
    assert all(0.0 < v <= 1.0 for v in spec["train/spec/acceptance"].values())  # sampled drafts may all pass
    assert vllm_loads(run["log"]) == [15] * STEPS
