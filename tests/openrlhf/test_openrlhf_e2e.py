"""OpenRLHF end to end as users launch it: a whole GRPO run through OpenRLHF's own ``train_ppo_ray``,
with Ray actors, DeepSpeed ZeRO-2 and the reference model (KL loss), on a tiny model on the CPU.

    python -m forkrl.plugins.openrlhf.cpu_run <OpenRLHF's flags> --forkrl.tree_packing
    python -m forkrl.plugins.openrlhf.cpu_run --stock <the same flags>     (OpenRLHF's own launcher)

Each runs in its own process (its own Ray) through forkrl's CPU run, as docs/cpu.md tells users: forkrl's
launcher (or OpenRLHF's with ``--stock``) unchanged, with OpenRLHF's own vLLM engines on vLLM's CPU
build (the weights synced through Ray), fake GPUs for Ray and device patches in every worker. Each run
must exit 0 and save (``--ckpt.output_dir``) a model whose parameters moved; forkrl's runs must log
``tree/*`` in OpenRLHF's own TensorBoard log (``--logger.tensorboard_dir``) every step, the stock run
none; the speculative run (``--forkrl.speculative_rollout``: forkrl's int4 drafter inside the engine)
logs ``spec/*`` every step. The reward is the fraction of digits in the response, through OpenRLHF's
custom reward file (``--reward.remote_url``), dense enough that every group has nonzero advantages.

The checkpointed tree run saves OpenRLHF's own training checkpoint every step
(``--ckpt.save_steps``), and another run resumes from its step-1 checkpoint (``--ckpt.load_enable``)
and must end where it ended. These two (this file; the vLLM runs are test_openrlhf_e2e_vllm.py's)
sample with the CPU run's Hugging Face rollout (``--rollout hf``): its samples are a function of the
weights and the prompts alone, where vLLM's depend on how its scheduler batched the requests, so
only it lets a resumed run see the uninterrupted run's rollouts.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from forkrl.plugins.openrlhf.testing_e2e import PROMPTS_PER_STEP
from forkrl.plugins.openrlhf.testing_e2e import launch as _launch
from forkrl.plugins.openrlhf.testing_e2e import saved_parameters as _parameters
from forkrl.plugins.openrlhf.testing_e2e import scalars as _scalars
from tests.openrlhf.e2e_checks import STEPS, assert_trained, build_data

pytestmark = pytest.mark.slow  # OpenRLHF's launcher end to end through Ray


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    return build_data(tmp_path_factory.mktemp("openrlhf-e2e"))


def _rollouts(log: str) -> list[tuple[str, int]]:
    """The Hugging Face rollout's requests in the order it served them: (prompt, weight load it sampled from)."""
    return [
        (m[1], int(m[2])) for m in re.finditer(r"cpu rollout: \d+ samples of '(.*?)' from load #(\d+)", log)
    ]


@pytest.fixture(scope="module")
def tree_run(data, tmp_path_factory) -> dict:
    """The forkrl run; it saves OpenRLHF's training checkpoint (DeepSpeed's, and a HF copy of the
    model) after each step, for the resume test."""
    out = tmp_path_factory.mktemp("tree")
    ckpt = ["--ckpt.save_steps", "1", "--ckpt.path", str(out / "ckpt"), "--ckpt.save_hf"]
    return _launch(
        "forkrl.plugins.openrlhf.train_ppo_ray", data, out, "--forkrl.tree_packing", *ckpt, rollout="hf"
    )


def test_the_tree_run_trains_and_logs_in_openrlhfs_own_log(data, tree_run):
    assert_trained(data, tree_run)
    scalars = _scalars(tree_run["out"] / "tb")
    tree = {tag: steps for tag, steps in scalars.items() if tag.startswith("train/tree/")}
    expected = {"train/tree/compression", "train/tree/unique_tokens", "train/tree/mode"}
    assert expected <= tree.keys(), sorted(scalars)
    for steps in tree.values():
        assert sorted(steps) == list(range(1, STEPS + 1))
    assert all(v > 1.0 for v in tree["train/tree/compression"].values())  # 4 samples share each prompt
    # the KL loss ran against the reference actor: zero at step 1 (policy == reference), then not
    assert scalars["train/kl"][1] == 0.0 and scalars["train/kl"][STEPS] > 0.0
    assert "Global step 2" in tree_run["log"]


def test_resuming_from_a_checkpoint_equals_the_uninterrupted_run(data, tree_run, tmp_path_factory):
    """forkrl resumed through OpenRLHF's own checkpointing reaches the uninterrupted run's parameters.

    The resumed run loads the tree run's step-1 checkpoint (``--ckpt.load_enable`` loads the newest
    tag under ``--ckpt.path``, so only that step is copied there): the DeepSpeed engine's parameters,
    fp32 master weights, Adam moments and LR schedule, and OpenRLHF's client state (global step,
    consumed prompts, the prompt loader's state). OpenRLHF then syncs those weights to the rollout
    before it generates, and continues the prompt order. forkrl keeps no state that changes the update:
    the tree is rebuilt from each step's rows, and its cost model only balances rows between ranks
    (one rank here). The CPU rollout samples from the weights and prompts alone (see
    ``forkrl.plugins.openrlhf.cpu_rollout``), so step 2 sees the same rollouts in both runs.

    One thing the checkpoint does not restore: the policy actor's torch RNG, from which ``ppo_train``
    shuffles the replay buffer, so the resumed step 2 shuffles its rows as the uninterrupted step 1 did
    (measured: [0, 2, 6, 4, 3, 7, 1, 5] against [0, 7, 4, 2, 5, 6, 1, 3]). forkrl trains the optimizer
    step's rows as one forest built from the sorted rows, so the order leaves no trace: the parameters
    are bitwise equal.
    """
    saved = tree_run["out"] / "ckpt"
    assert (saved / "_actor" / "latest").read_text().strip() == f"global_step{STEPS}"
    out = tmp_path_factory.mktemp("resumed")
    shutil.copytree(saved / "_actor" / "global_step1", out / "ckpt" / "_actor" / "global_step1")
    (out / "ckpt" / "_actor" / "latest").write_text("global_step1")
    resumed = _launch(
        "forkrl.plugins.openrlhf.train_ppo_ray",
        data,
        out,
        "--forkrl.tree_packing",
        "--ckpt.path",
        str(out / "ckpt"),
        "--ckpt.load_enable",
        rollout="hf",
    )

    # only step 2 ran, on the prompts the uninterrupted run's step 2 had, from the step-1 weights
    # (load #1: the sync after loading the checkpoint came before any generation)
    assert "Global step 1:" not in resumed["log"] and "Global step 2:" in resumed["log"]
    scalars = _scalars(out / "tb")
    assert sorted(scalars["train/policy_loss"]) == [STEPS]
    uninterrupted = _rollouts(tree_run["log"])
    assert [n for _, n in uninterrupted] == [0] * PROMPTS_PER_STEP + [1] * PROMPTS_PER_STEP
    assert _rollouts(resumed["log"]) == uninterrupted[PROMPTS_PER_STEP:]

    step1 = _parameters(saved / "global_step1_hf")
    final = _parameters(tree_run["out"] / "final")
    again = _parameters(out / "final")
    assert again.keys() == final.keys() == step1.keys()
    assert max((final[n] - step1[n]).abs().max().item() for n in final) > 1e-3  # step 2 moved them
    differ = {
        n: (again[n] - final[n]).abs().max().item() for n in final if not torch.equal(again[n], final[n])
    }
    assert not differ, differ
