"""``--forkrl.speculative_rollout``: the flags through OpenRLHF's real command line, and the engine
arguments forkrl adds to each of OpenRLHF's vLLM engines (checked against vLLM's AsyncEngineArgs).
The drafter's re-sync inside vLLM is tested in test_vllm_drafter.py."""

from __future__ import annotations

import sys

import pytest

from forkrl.plugins.openrlhf import testing as h
from forkrl.plugins.openrlhf import train_ppo_ray
from forkrl.plugins.openrlhf.options import parse_flags
from forkrl.plugins.openrlhf.rollout import SpeculativeRolloutActor

SPEC = (
    "--forkrl.speculative_rollout",
    "--forkrl.speculative_policy",
    "always",
    "--forkrl.speculative_draft_len",
    "5",
)


def test_flags_reach_openrlhf_args():
    args = h.parse_args(
        h.command("some/model", *SPEC, "--forkrl.speculative_bits", "8", "--forkrl.tree_packing")
    )
    assert args.forkrl.speculative_rollout is True and args.forkrl.speculative_draft_len == 5
    assert args.forkrl.speculative_bits == 8 and args.forkrl.tree_packing is True


def test_the_one_policy_openrlhf_runs_is_the_default():
    """OpenRLHF starts its vLLM engines before any policy exists to time, so 'always' is the only
    policy; it is the default with --forkrl.speculative_rollout and 'auto' is not offered."""
    args = h.parse_args(h.command("some/model", "--forkrl.speculative_rollout"))
    assert args.forkrl.speculative_policy == "always" and args.forkrl.speculative_draft_len is None
    assert parse_flags(["--x"])[0].speculative_policy == "auto"  # off: core's default, nothing set


@pytest.mark.parametrize(
    "extra,message",
    [
        (("--forkrl.speculative_rollout", "--forkrl.speculative_policy", "auto"), "invalid choice: 'auto'"),
        (
            ("--forkrl.speculative_rollout", "--forkrl.speculative_margin", "0.2"),
            "--forkrl.speculative_margin is not taken by OpenRLHF's launcher",
        ),
        ((*SPEC, "--vllm.num_engines", "0"), "--vllm.num_engines >= 1"),
    ],
)
def test_refusals_before_anything_starts(extra, message, capsys):
    with pytest.raises(SystemExit) as err:
        h.parse_args(h.command("some/model", *extra))
    assert message in str(err.value) + capsys.readouterr().err


def test_refused_before_anything_starts_where_forkrls_vllm_plugin_cannot_install(monkeypatch, capsys):
    """A vLLM release that moved what forkrl's plugin needs (here the model runner's module): the
    launcher says so before Ray starts, not an engine with an unknown quantization after it."""
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", None)
    with pytest.raises(SystemExit) as err:
        h.parse_args(h.command("some/model", *SPEC))
    message = str(err.value) + capsys.readouterr().err
    assert "vLLM plugin, which does not install in vLLM 0.29.0" in message, message
    assert "drop --forkrl.speculative_rollout" in message


def test_engine_arguments_get_the_drafter():
    """Each engine's kwargs (as create_vllm_engines builds them) gain forkrl's speculative_config, which
    vLLM's own AsyncEngineArgs accepts; Ray's placement options pass through unchanged."""
    import vllm

    calls = []

    class Handle:
        def __init__(self, ray_options=None):
            self.ray_options = ray_options

        def options(self, **kw):
            return Handle(kw)

        def remote(self, *args, **kwargs):
            calls.append((self.ray_options, kwargs))
            return "engine"

    from openrlhf.trainer.ray import vllm_engine

    options, _ = parse_flags(list(SPEC))
    actor = SpeculativeRolloutActor(vllm_engine.RolloutRayActor, options)
    engine_class = actor.actor_class.__ray_actor_class__  # OpenRLHF's, with spec_counters added
    assert issubclass(engine_class, vllm_engine.RolloutRayActor.__ray_actor_class__)
    assert callable(engine_class.spec_counters)
    actor.actor_class = Handle()  # what Ray would start, recorded instead
    engine_kwargs = {"model": "org/policy", "tensor_parallel_size": 2, "seed": 3, "dtype": "bfloat16"}
    assert actor.options(num_cpus=1, num_gpus=1).remote(**engine_kwargs, bundle_indices=None) == "engine"
    ray_options, kwargs = calls[0]
    assert ray_options == {"num_cpus": 1, "num_gpus": 1}
    assert kwargs["speculative_config"] == {
        "method": "draft_model", "model": "org/policy", "num_speculative_tokens": 5,
        "quantization": "forkrl_int4_g128", "draft_tensor_parallel_size": 2, "draft_sample_method": "probabilistic",
    }  # fmt: skip
    kwargs.pop("bundle_indices")
    assert vllm.AsyncEngineArgs(**kwargs).speculative_config == kwargs["speculative_config"]
    with pytest.raises(ValueError, match="already has a speculative_config"):
        actor.remote(**kwargs)


def test_launcher_swaps_the_engine_and_trainer_classes_only_while_it_runs(monkeypatch):
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import vllm_engine

    original, trainer, seen = vllm_engine.RolloutRayActor, ppo_trainer.PPOTrainer, []

    def run_host(argv):
        seen.append((vllm_engine.RolloutRayActor, ppo_trainer.PPOTrainer))

    monkeypatch.setattr(train_ppo_ray, "run_host", run_host)
    train_ppo_ray.main(h.command("some/model", *SPEC))
    engine, spec_trainer = seen[0]
    assert isinstance(engine, SpeculativeRolloutActor)
    assert issubclass(engine.actor_class.__ray_actor_class__, original.__ray_actor_class__)
    assert issubclass(spec_trainer.__ray_actor_class__, trainer.__ray_actor_class__)
    assert "_compute_rollout_stats" in vars(spec_trainer.__ray_actor_class__)  # logs spec/*
    assert vllm_engine.RolloutRayActor is original and ppo_trainer.PPOTrainer is trainer
    train_ppo_ray.main(h.command("some/model"))
    assert seen[1] == (original, trainer)  # without the flag nothing is swapped
