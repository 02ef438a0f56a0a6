"""The launcher: OpenRLHF's real command line parsed by OpenRLHF's own __main__ with forkrl's flags
taken off and attached; bad forkrl flags and refused OpenRLHF settings fail before Ray starts; the
actor classes and options that reach Ray's workers are forkrl's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forkrl.core.options import option_docs
from forkrl.plugins.openrlhf import testing as h
from forkrl.plugins.openrlhf.options import FLAG_OVERRIDES, FLAGS, ForkrlOptions, parse_flags

ROOT = Path(__file__).resolve().parents[2]


def test_deepspeed_contract():
    """What forkrl's ZeRO-3 gathering relies on (forkrl.plugins.deepspeed), on a real partition."""
    from forkrl.plugins import deepspeed as forkrl_deepspeed

    forkrl_deepspeed.check()


def test_real_command_line_parses_and_forkrl_flags_arrive():
    args = h.parse_args(
        h.command("some/model", "--forkrl.tree_packing", "--forkrl.tree_mode", "replay", "--forkrl.tree_block_size",
                  "64", "--actor.entropy_coef", "0.01")
    )  # fmt: skip
    assert args.forkrl.tree_packing is True
    assert args.forkrl.tree_mode == "replay" and args.forkrl.tree_block_size == 64
    # OpenRLHF's own parsing and validation ran: its flags, and what its __main__ derives.
    assert args.actor.model_name_or_path == "some/model" and args.actor.entropy_coef == 0.01
    assert args.actor.eps_clip_low_high == (args.actor.eps_clip, args.actor.eps_clip)
    assert args.critic.model_name_or_path is None  # group_norm has no critic
    assert not hasattr(args, "forkrl.tree_packing")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--forkrl.tree_pack"], "unknown forkrl flag --forkrl.tree_pack"),
        (["--forkrl.tree_packing", "--forkrl.tree_mode", "fast"], "invalid choice: 'fast'"),
        (["--forkrl.tree_mode", "keep"], "tree_mode set but tree_packing=False"),
        (["--forkrl.long_context_replay", "--forkrl.tree_mode", "keep"], "contradicts tree_mode='keep'"),
        (["--forkrl.tree_packing", "maybe"], "expected true or false"),
        (
            ["--forkrl.speculative_rollout", "--forkrl.speculative_margin", "0.2"],
            "--forkrl.speculative_margin is not taken by OpenRLHF's launcher: it is read only by the 'auto' "
            "speculation policy",
        ),
    ],
)
def test_bad_forkrl_flags_are_usage_errors(capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        parse_flags(["--actor.model_name_or_path", "m", *argv])
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,needle",
    [
        (
            ["--ds.ring_attn_size", "2", "--ds.packing_samples", "--forkrl.tree_balance", "on"],
            "a ring-attention group (--ds.ring_attn_size > 1) does not do",
        ),
        (["--ds.param_dtype", "fp16"], "--ds.param_dtype fp16"),
        (
            [
                "--forkrl.tree_balance",
                "on",
                "--actor.aux_loss_coef",
                "0.01",
                "--actor.num_gpus_per_node",
                "2",
            ],
            "--forkrl.tree_balance on would change the update",
        ),
        (["--forkrl.tree_balance", "on"], "this run has one"),
        (
            ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "64"],
            "--train.dynamic_batch_enable",
        ),
    ],
)
def test_refused_openrlhf_settings_fail_before_ray(extra, needle):
    argv = h.command("m", "--forkrl.tree_packing")
    with pytest.raises(SystemExit) as info:
        h.parse_args([*argv, *extra])
    assert needle in str(info.value.code) and "or train without --forkrl.tree_packing" in str(info.value.code)
    # one prefix for every error the launcher gives, as argparse's usage errors have
    assert str(info.value.code).startswith("python -m forkrl.plugins.openrlhf.train_ppo_ray: error: ")


def test_the_docs_offer_only_flags_the_launcher_takes():
    """docs/openrlhf.md names no forkrl option the launcher refuses: every ``--forkrl.X`` it writes is
    a flag, and the options OpenRLHF's launcher does not take are not mentioned at all."""
    import re

    from forkrl.plugins.openrlhf.options import NOT_TAKEN

    text = (ROOT / "docs" / "openrlhf.md").read_text()
    named = set(re.findall(r"--forkrl\.(\w+)", text))
    assert named and named <= set(FLAGS), sorted(named - set(FLAGS))
    assert NOT_TAKEN and not [name for name in NOT_TAKEN if name in text]


@pytest.mark.parametrize("path", ["/no/such/dir", "./no-such-dir", "no/such/dir"])
def test_a_missing_model_folder_is_refused_before_ray(monkeypatch, path):
    """The launcher's own run (not the dry parse): a model path that is neither a folder here nor a
    hub id fails with forkrl's message before ``train`` could start Ray or load anything."""
    import ray

    from forkrl.plugins.openrlhf import train_ppo_ray

    def start(*args, **kwargs):
        raise AssertionError("Ray started")

    monkeypatch.setattr(ray, "init", start)
    with pytest.raises(SystemExit) as info:
        train_ppo_ray.main(h.command(path))
    message = str(info.value.code)
    assert message.startswith(
        "python -m forkrl.plugins.openrlhf.train_ppo_ray: error: --actor.model_name_or_path"
    )
    assert f"{path!r}: no such model folder or hub id" in message


def test_ring_attention_is_accepted():
    """What a ring-attention user already passes; the update: ``test_openrlhf_ring``."""
    args = h.parse_args(
        [*h.command("m", "--forkrl.tree_packing"), "--ds.ring_attn_size", "2", "--ds.packing_samples"]
    )
    assert args.ds.ring_attn_size == 2 and args.forkrl.tree_packing


def test_zero_stage_3_is_accepted_also_with_dynamic_batches():
    argv = h.command(
        "m", "--forkrl.tree_packing", "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "64"
    )
    argv[argv.index("--ds.zero_stage") + 1] = "3"
    args = h.parse_args(argv)
    assert args.ds.zero_stage == 3 and args.forkrl.tree_packing


def test_help_lists_forkrl_and_openrlhf_flags():
    out = subprocess.run(
        [sys.executable, "-m", "forkrl.plugins.openrlhf.train_ppo_ray", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--actor.model_name_or_path" in out.stdout
    text = " ".join(out.stdout.split())
    flat = "".join(out.stdout.split())  # argparse wraps lines, also after hyphens
    for doc in option_docs(ForkrlOptions, only=FLAGS, overrides=FLAG_OVERRIDES):  # help == documented text
        assert f"--forkrl.{doc.name}" in text and "".join(doc.help.split()) in flat, doc.name
    assert "equal rows per rank" not in text.replace("TRL keeps equal rows per rank", "")
    assert "--forkrl.speculative_policy {always}" in text and "--forkrl.speculative_margin" not in text


def test_what_reaches_ray_workers_is_forkrl(tmp_path):
    """Ray pickles actor classes by reference and ships the strategy (args) by value: in a fresh
    process (as a Ray worker is), the policy class resolves to forkrl's, its trainer is forkrl's
    during ``init_model_from_pretrained``, and the strategy carries forkrl's options."""
    from ray import cloudpickle

    from forkrl.plugins.openrlhf import actors

    args = h.parse_args(h.command("m", "--forkrl.tree_packing", "--forkrl.tree_mode", "keep"))
    payload = tmp_path / "payload.pkl"
    strategy = h.get_strategy(args)
    payload.write_bytes(cloudpickle.dumps((actors.PolicyModelActor.__ray_actor_class__, strategy)))
    script = textwrap.dedent(
        f"""
        import pickle, sys
        from unittest import mock
        cls, strategy = pickle.loads(open({str(payload)!r}, "rb").read())
        from openrlhf.trainer.ray import ppo_actor
        from forkrl.plugins.openrlhf.options import options_from
        from forkrl.plugins.openrlhf.trainer import TreeActorPPOTrainer
        seen = []
        host = cls.__mro__[1]
        with mock.patch.object(host, "init_model_from_pretrained", lambda self, *a, **k: seen.append(ppo_actor.ActorPPOTrainer)):
            cls.init_model_from_pretrained(object.__new__(cls), strategy, "m")
        assert cls.__module__ == "forkrl.plugins.openrlhf.actors", cls.__module__
        assert seen == [TreeActorPPOTrainer], seen
        assert ppo_actor.ActorPPOTrainer is not TreeActorPPOTrainer  # restored after
        o = options_from(strategy.args)
        assert o.tree_packing and o.tree_mode == "keep", o
        print("ok")
        """
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_readme_command_parses_and_passes_openrlhfs_checks(monkeypatch):
    """The README's complete OpenRLHF command, pasted unchanged (from the repo root, where its
    reward file lies): OpenRLHF's own __main__ parses and validates it, forkrl's flags arrive."""
    from ..readme_commands import command

    argv = command("python -m forkrl.plugins.openrlhf.train_ppo_ray")
    monkeypatch.chdir(ROOT)
    args = h.parse_args(argv[3:])
    assert args.forkrl.tree_packing is True
    assert args.rollout.n_samples_per_prompt == 8 and args.ds.zero_stage == 2
    assert args.algo.advantage.estimator == "group_norm" and args.algo.kl.use_loss
    assert [Path(u).is_file() for u in args.reward.remote_url] == [True]  # OpenRLHF takes a list
    assert (
        args.data.prompt_dataset == "openai/gsm8k@main"
    )  # @: the dataset's folder (its config), as OpenRLHF reads it
