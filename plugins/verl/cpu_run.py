"""A CPU smoke run of veRL's own ``main_ppo`` with forkrl's YAML (or stock veRL), on your own tiny
model: for trying the plugin end to end on a machine without a GPU, and for forkrl's CI. Not for
training: nothing is fast.

    python -m forkrl.plugins.verl.cpu_run --config-name forkrl_tree --model /tmp/tiny/model \\
        data.train_files=/tmp/tiny/train.parquet data.val_files=/tmp/tiny/val.parquet \\
        reward.custom_reward_function.path=/tmp/tiny/reward.py [--rollout vllm|hf] [more veRL overrides]

It runs ``python -m verl.trainer.main_ppo`` in a child process (its exit status is this command's)
with forkrl's config folder and ``--config-name`` (``forkrl_tree``, ``forkrl_long_context``,
``forkrl_speculative``, ``forkrl_tree_speculative``; ``ppo_trainer`` is stock veRL's own config),
then :data:`CPU_OVERRIDES`, the rollout's overrides, then :data:`SMOKE_SIZES` (a few GRPO steps of
a tiny batch), then yours (a key you set replaces ours), and the environment of
:func:`environment`. ``--model DIR`` is ``actor_rollout_ref.model.path=DIR``.

The rollout (``--rollout``; default ``vllm`` where vLLM's CPU build is installed, as
``scripts/setup.sh test`` does in veRL's environment):

- ``vllm``: veRL's own vLLM server (``vLLMReplica``, hybrid mode) on vLLM's CPU build
  (:data:`VLLM_OVERRIDES`: eager, bf16, no sleep mode, which vLLM has only on GPUs), its weights
  synced by veRL's own bucketed transfer (its shared-memory path, as where CUDA IPC is missing).
  forkrl's vLLM plugin keeps the engine's linear weights dense (``FORKRL_VLLM_DENSE_CPU``): vLLM's
  CPU worker repacks them into a form that takes no ``load_weights``. The policy's attention head
  dimension must be one vLLM's CPU attention has (32, 64, 80, 96, ...).
- ``hf``: ``hf_cpu`` (:mod:`.cpu_rollout`), Hugging Face ``generate`` from the weights veRL syncs
  after every update, for machines without vLLM's CPU build; the speculative configs need vLLM.

What else is a stand-in on the CPU (:mod:`.cpu_host`, which veRL imports in every process through
its own ``VERL_USE_EXTERNAL_MODULES``): the device platform (:mod:`.cpu_platform`: gloo, no device
memory, fake "GPU" resources for Ray's placement) and two device patches (the duplicated gloo
backend string, unpinned CPU offload). veRL's trainer, workers, TransferQueue, agent loop, reward
loop, weight sync and checkpointing are its own; forkrl's engine and stock veRL's train as they
would on a GPU, in float32 with bf16 autocast (veRL's default mixed precision) and sdpa attention.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from . import CONFIG_DIR

__all__ = [
    "CPU_OVERRIDES", "HOST_MODULE", "PLATFORM", "ROLLOUT", "ROLLOUTS", "SMOKE_SIZES", "VLLM_OVERRIDES", "command",
    "default_rollout", "environment", "main",
]  # fmt: skip

#: The rollout backend that stands in for vLLM where vLLM's CPU build is missing (:mod:`.cpu_rollout`).
ROLLOUT = "hf_cpu"
#: ``--rollout`` choices: veRL's vLLM server on vLLM's CPU build, or :data:`ROLLOUT`.
ROLLOUTS = ("vllm", "hf")
#: The module veRL imports in every process of a CPU run (:mod:`.cpu_host`).
HOST_MODULE = "forkrl.plugins.verl.cpu_host"
#: The CPU platform's name for ``VERL_PLATFORM`` (:mod:`.cpu_platform` registers it): here, so that
#: the launcher builds the environment without importing torch and veRL (about 5 s of CPU per run).
PLATFORM = "forkrl_cpu"

#: What a CPU machine needs, each for the reason given.
CPU_OVERRIDES = (
    "++actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no flash-attention on a CPU
    "actor_rollout_ref.actor.strategy=fsdp2",  # FSDP1 refuses CPU parameters
    "actor_rollout_ref.ref.strategy=fsdp2",
    "actor_rollout_ref.actor.use_torch_compile=False",
    "actor_rollout_ref.ref.use_torch_compile=False",
    # the engine's entropy under torch.compile: inductor builds C++ at the first step (about 20 s)
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
    "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",  # else 8 storage actors at 1 CPU each
    "ray_kwargs.ray_init.num_cpus=16",  # Ray's logical CPUs for veRL's actors (2 hangs after the config print)
    "++ray_kwargs.ray_init.num_gpus=1",  # what the CPU platform's placement asks for
    "++ray_kwargs.ray_init.address=local",  # a Ray of this run's own, never a running cluster
    "++ray_kwargs.ray_init.include_dashboard=False",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "data.dataloader_num_workers=0",
)

#: veRL's vLLM rollout on vLLM's CPU build, each for the reason given.
VLLM_OVERRIDES = (
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.enforce_eager=True",  # no CUDA graphs
    "actor_rollout_ref.rollout.dtype=bfloat16",
    "++actor_rollout_ref.rollout.enable_sleep_mode=False",  # vLLM's sleep mode exists on GPUs only
    "actor_rollout_ref.rollout.free_cache_engine=False",  # (it frees the cache through sleep mode)
    "actor_rollout_ref.rollout.max_model_len=1024",
    "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
    "actor_rollout_ref.rollout.max_num_seqs=16",
)

#: A few GRPO steps of a tiny batch (2 prompts x 4 samples, 16 response tokens, 2 steps).
SMOKE_SIZES = (
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=2",
    "data.max_prompt_length=128",
    "data.max_response_length=16",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "trainer.total_training_steps=2",
    "trainer.val_before_train=False",
    "trainer.test_freq=-1",
    "trainer.logger=[console]",
)

#: forkrl's configs that need vLLM (its drafter runs in vLLM's engine).
_NEEDS_VLLM = ("forkrl_speculative", "forkrl_tree_speculative")


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def default_rollout() -> str:
    """``vllm`` where vLLM's CPU build is installed, else ``hf``."""
    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def command(
    config_name: str, overrides: Sequence[str] = (), python: str = sys.executable, rollout: str = "hf"
) -> list[str]:
    """The ``main_ppo`` command line of a CPU run: forkrl's ``config_name`` (``ppo_trainer``: stock
    veRL's), :data:`CPU_OVERRIDES`, the rollout's (``rollout``: one of :data:`ROLLOUTS`) and
    :data:`SMOKE_SIZES` without the keys ``overrides`` sets, then ``overrides``.

    Raises:
        ValueError: a speculative config with the ``hf`` rollout; with ``vllm``, sleep mode or a
            policy whose attention head dimension vLLM's CPU attention lacks.
    """
    if rollout not in ROLLOUTS:
        raise ValueError(f"--rollout {rollout}: use {' or '.join(ROLLOUTS)}")
    yours = {_key(o): o.split("=", 1)[-1] for o in overrides}
    if rollout == "hf":
        if config_name in _NEEDS_VLLM:
            raise ValueError(
                f"--config-name {config_name} drafts inside vLLM's engine, which the hf rollout replaces with "
                "Hugging Face generate: pass --rollout vllm (scripts/setup.sh test installs vLLM's CPU build in "
                "veRL's environment), or use forkrl_tree or forkrl_long_context"
            )
        rollout_overrides: tuple[str, ...] = (f"actor_rollout_ref.rollout.name={ROLLOUT}",)
    else:
        if yours.get("actor_rollout_ref.rollout.enable_sleep_mode", "False").lower() == "true":
            raise ValueError(
                "actor_rollout_ref.rollout.enable_sleep_mode=True: vLLM's sleep mode frees GPU memory and exists "
                "on GPUs only: drop it"
            )
        from forkrl.plugins.vllm import check_cpu_head_size

        check_cpu_head_size(yours.get("actor_rollout_ref.model.path", ""), fix="pass --rollout hf")
        rollout_overrides = VLLM_OVERRIDES
    cmd = [python, "-m", "verl.trainer.main_ppo"]
    if (CONFIG_DIR / f"{config_name}.yaml").is_file():
        cmd += ["--config-path", str(CONFIG_DIR)]
    cmd += ["--config-name", config_name]
    ours = (*CPU_OVERRIDES, *rollout_overrides, *SMOKE_SIZES)
    return cmd + [o for o in ours if _key(o) not in yours] + list(overrides)


def environment(base: Mapping[str, str] | None = None, rollout: str = "hf") -> dict[str, str]:
    """``base`` (default: this process's environment) for a CPU run: ``VERL_USE_EXTERNAL_MODULES``
    starts with :data:`HOST_MODULE` (your modules follow it, and may override what it registers),
    ``VERL_PLATFORM=forkrl_cpu``, ``VERL_ENGINE_DEVICE=cuda`` (veRL registers its FSDP engines for
    cuda/npu only; the tensors stay on the CPU), no ``RAY_ADDRESS`` (the run starts its own Ray),
    and quieter defaults (tokenizer threads, Ray usage statistics, Ray's idle workers) unless set;
    for the ``vllm`` rollout, forkrl's dense CPU linears and 1 GiB of vLLM's CPU cache unless set."""
    env = dict(os.environ if base is None else base)
    modules = [m for m in env.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m and m != HOST_MODULE]
    env["VERL_USE_EXTERNAL_MODULES"] = ",".join([HOST_MODULE, *modules])
    env["VERL_PLATFORM"] = PLATFORM
    env["VERL_ENGINE_DEVICE"] = "cuda"
    env.pop("RAY_ADDRESS", None)
    for key, value in dict(
        TOKENIZERS_PARALLELISM="false",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_enable_worker_prestart="0",
        HYDRA_FULL_ERROR="1",
    ).items():
        env.setdefault(key, value)
    if rollout == "vllm":
        from forkrl.plugins.vllm import DENSE_CPU

        env[DENSE_CPU] = "1"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def main(argv: Sequence[str] | None = None) -> int:
    """Run veRL's ``main_ppo`` as a CPU smoke run; returns its exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m forkrl.plugins.verl.cpu_run",
        description="veRL's main_ppo on a CPU machine, with forkrl's YAML.",
        epilog="Any other argument is a veRL (Hydra) override, e.g. data.train_files=... trainer.total_training_steps=4.",
    )
    parser.add_argument(
        "--config-name",
        default="forkrl_tree",
        help="forkrl_tree (default), forkrl_long_context, forkrl_speculative, forkrl_tree_speculative, or "
        "ppo_trainer (stock veRL)",
    )
    parser.add_argument("--model", help="the policy's folder (actor_rollout_ref.model.path)")
    parser.add_argument(
        "--rollout",
        choices=ROLLOUTS,
        default=None,
        help="vllm: veRL's vLLM server on vLLM's CPU build (default where installed); hf: Hugging Face generate",
    )
    args, overrides = parser.parse_known_args(argv)
    if args.model:
        overrides = [f"actor_rollout_ref.model.path={args.model}", *overrides]
    rollout = args.rollout or default_rollout()
    try:
        cmd = command(args.config_name, overrides, rollout=rollout)
    except ValueError as err:
        parser.error(str(err))
    return subprocess.call(cmd, env=environment(rollout=rollout))


if __name__ == "__main__":
    sys.exit(main())
