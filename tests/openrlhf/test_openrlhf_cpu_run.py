"""forkrl's CPU run (``python -m forkrl.plugins.openrlhf.cpu_run``), before it starts anything: a
setting a CPU cannot run, or a missing model folder, is refused by name before Ray starts, and Ray
is given the logical GPUs the run's actor groups ask for. The whole run, forkrl's and stock's:
``test_openrlhf_e2e.py``."""

from __future__ import annotations

import pytest

from forkrl.plugins.openrlhf import cpu_run
from forkrl.plugins.openrlhf import testing as h


@pytest.fixture
def no_ray(monkeypatch):
    """``ray.init`` fails the test: what is checked here must be refused before Ray starts."""
    import ray

    def start(*args, **kwargs):
        raise AssertionError("Ray started")

    monkeypatch.setattr(ray, "init", start)
    monkeypatch.setattr(cpu_run, "CPU_ENV", {})  # leave this process's environment alone


def _argv(*extra: str) -> list[str]:
    return [*h.command("some/model", "--ds.attn_implementation", "sdpa"), *extra]


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--ds.attn_implementation", "flash_attention_2"], "--ds.attn_implementation flash_attention_2"),
        (["--ds.ring_attn_size", "2"], "--ds.packing_samples (which --ds.ring_attn_size > 1"),
        (["--vllm.num_engines", "0"], "pass --vllm.num_engines 1"),
        (["--ds.lora.rank", "4"], "--ds.lora.rank > 0"),
        (["--train.colocate_all", "--vllm.enable_sleep"], "--vllm.enable_sleep"),
    ],
)
@pytest.mark.parametrize("rollout", ["vllm", "hf"])
def test_what_a_cpu_cannot_run_is_refused_before_ray(no_ray, extra, needle, rollout):
    with pytest.raises(SystemExit) as info:
        cpu_run.run(_argv(*extra), rollout=rollout)
    message = str(info.value.code)
    assert (
        message.startswith("python -m forkrl.plugins.openrlhf.cpu_run: error: on a CPU, ")
        and needle in message
    )


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--forkrl.speculative_rollout"], "--forkrl.speculative_rollout drafts inside vLLM's engines"),
        (["--algo.advantage.is_correction_level", "token"], "--algo.advantage.is_correction_level"),
    ],
)
def test_what_only_vllm_engines_serve_is_refused_with_the_hf_rollout(extra, needle):
    args = h.parse_args(_argv("--reward.remote_url", "r.py", *extra))
    with pytest.raises(ValueError, match=needle) as info:
        cpu_run.check_cpu_args(args, "hf")
    assert "scripts/setup.sh test installs it" in str(info.value)
    cpu_run.check_cpu_args(args, "vllm")  # OpenRLHF's engines on vLLM's CPU build serve it


def test_a_head_size_vllms_cpu_attention_lacks_is_refused_before_ray(no_ray, tmp_path):
    from forkrl.core.testing.models import byte_llama, byte_tokenizer, save_pretrained

    model = save_pretrained(byte_llama(0), byte_tokenizer(), tmp_path / "model")  # head dimension 8
    argv = [*h.command(str(model), "--ds.attn_implementation", "sdpa")]
    with pytest.raises(SystemExit, match="head dimension 8 .* pass --rollout hf"):
        cpu_run.run(argv, rollout="vllm")


def test_an_unknown_rollout_is_refused(no_ray):
    with pytest.raises(SystemExit, match="--rollout sglang: choose one of vllm, hf"):
        cpu_run.main(["--rollout", "sglang", *_argv()])


def test_openrlhfs_default_attention_is_refused_by_name(no_ray):
    """OpenRLHF's default --ds.attn_implementation is flash_attention_2: the message names the fix."""
    argv = h.command("some/model")
    with pytest.raises(SystemExit, match="pass --ds.attn_implementation sdpa"):
        cpu_run.run(argv)


def test_a_missing_model_folder_is_refused_before_ray(no_ray):
    with pytest.raises(SystemExit) as info:
        cpu_run.main(["--stock", *h.command("/no/such/dir", "--ds.attn_implementation", "sdpa")])
    message = str(info.value.code)
    assert message.startswith("python -m forkrl.plugins.openrlhf.cpu_run: error: --actor.model_name_or_path")
    assert "'/no/such/dir': no such model folder or hub id" in message


def test_stock_takes_no_forkrl_flags(no_ray):
    with pytest.raises(SystemExit, match="--stock runs OpenRLHF's own launcher, which takes no --forkrl"):
        cpu_run.main(["--stock", *_argv("--forkrl.tree_packing")])


@pytest.mark.parametrize(
    "extra,gpus",
    [
        ([], 2),  # policy and reference (--algo.kl.init_coef 0.01, the default): 1 GPU each
        (["--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2"], 4),
        (["--train.colocate_actor_ref"], 1),
        (["--algo.kl.init_coef", "0"], 1),
    ],
)
def test_ray_gets_a_logical_gpu_for_each_that_the_actor_groups_ask_for(extra, gpus):
    args = h.parse_args(_argv("--reward.remote_url", "r.py", *extra))
    assert cpu_run.ray_resources(args, "hf") == {"num_cpus": gpus + 2, "num_gpus": gpus}
    engine = 0 if "--train.colocate_all" in extra else 1  # OpenRLHF's engines hold one each
    assert cpu_run.ray_resources(args, "vllm") == {"num_cpus": gpus + engine + 2, "num_gpus": gpus + engine}
