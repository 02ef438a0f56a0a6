"""The CPU run's device patches: what OpenRLHF 0.11.2's own ``train_ppo_ray`` needs, in every Ray
worker, to train on a CPU machine (:mod:`~forkrl.plugins.openrlhf.cpu_run`).

OpenRLHF assumes CUDA GPUs in a few places that have nothing to do with the training math: device
selection and synchronisation, the device mesh, where the replay buffer puts its tensors, and the
optimizer's compiled kernel. Each patch below replaces one of them and says why the PPO/GRPO update
(log-probs, advantages, loss, gradients, the optimizer step) cannot change. Everything else, stock
OpenRLHF's or forkrl's, runs unmodified: its CLI, argument checks, Ray actors, DeepSpeed ZeRO engine,
experience maker, replay buffer, trainer loop, logging and saving. How the weights reach the rollout
is the rollout's (:data:`forkrl.plugins.openrlhf.cpu_rollout.WORKER_PATCHES`), registered here too.

Ray builds actor classes by importing their modules in the worker, so patches made in the driver
never reach the policy or reference actors: :func:`apply_worker` is Ray's
``worker_process_setup_hook``. It only registers the patches; each runs right after its OpenRLHF
module is first imported in the worker, so workers that never import OpenRLHF (the rollout) pay
nothing. Only the CPU run installs them; nothing else in forkrl imports this module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["DEVICE_PATCHES", "SEED", "apply_worker", "worker_patches"]


def cuda_calls_on_cpu(torch: ModuleType) -> None:
    """``torch.cuda.set_device`` and ``torch.cuda.synchronize`` do nothing; ``torch.cuda.current_device()``
    answers ``"cpu"``.

    OpenRLHF calls them unconditionally (``DeepspeedStrategy.setup_distributed``, the trainers'
    barriers, ``ppo_train``, the actors' ``forward``, the strategy's ``all_reduce``/``all_gather``);
    torch built without CUDA raises. Why not the math: CPU kernels are synchronous, so there is nothing
    to wait for, and ``current_device()`` is only ever used as the place to move tensors to, which on
    this machine is the CPU. Each replacement is its own function (dynamo refuses two torch names bound
    to one object).
    """

    def set_device(device: Any) -> None:
        del device

    def synchronize(device: Any = None) -> None:
        del device

    def current_device() -> str:
        return "cpu"

    torch.cuda.set_device = set_device
    torch.cuda.synchronize = synchronize
    torch.cuda.current_device = current_device


def cpu_device_mesh(module: ModuleType) -> None:
    """``openrlhf.utils.deepspeed.deepspeed.init_device_mesh`` builds its ``(dp, sp, tp)`` mesh on the CPU.

    ``DeepspeedStrategy.setup_distributed`` asks for a ``"cuda"`` mesh. Why not the math: the mesh only
    names the ranks of each group (here dp = world size, sp = tp = 1); the collectives over it are
    gloo's on the CPU.
    """
    host = module.init_device_mesh

    def init_device_mesh(device_type: str, *args: Any, **kwargs: Any) -> Any:
        del device_type
        return host("cpu", *args, **kwargs)

    module.init_device_mesh = init_device_mesh


def torch_adam(strategy_cls: type) -> None:
    """OpenRLHF's ``AdamW`` DeepSpeed config gets DeepSpeed's documented ``"torch_adam": true``.

    Without it DeepSpeed builds its ``FusedAdam``, whose CPU kernel is compiled on first use (minutes
    on a two-core machine, in every new ``TORCH_EXTENSIONS_DIR``).
    Why not the math: ``torch.optim.AdamW`` is the same update (decoupled weight decay, the same lr,
    betas, eps and weight decay from OpenRLHF's config, inside the same ZeRO optimizer with the same
    clipping and scheduler); only the kernel differs, by float rounding.
    """
    host = strategy_cls.get_ds_train_config

    def get_ds_train_config(self: Any, optim_dict: dict | None = None, **kwargs: Any) -> dict:
        config = host(self, optim_dict, **kwargs)
        optimizer = config.get("optimizer")
        if optimizer and optimizer.get("type") == "AdamW":
            optimizer["params"]["torch_adam"] = True
        return config

    strategy_cls.get_ds_train_config = get_ds_train_config


def cpu_replay_buffer(module: ModuleType) -> None:
    """``NaiveReplayBuffer`` samples onto the CPU.

    Its ``__init__`` builds ``torch.device(f"cuda:{torch.cuda.current_device()}")``. Why not the math:
    the target device is only where sampled micro-batches are moved; the buffer's contents, splitting
    and shuffling are OpenRLHF's.
    """
    import torch

    host = module.NaiveReplayBuffer.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        answer = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0  # only for the f-string; replaced right after
        try:
            host(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = answer
        self.target_device = torch.device("cpu")

    module.NaiveReplayBuffer.__init__ = __init__


def _strategy_module(module: ModuleType) -> None:
    import torch

    cuda_calls_on_cpu(torch)
    cpu_device_mesh(module)
    torch_adam(module.DeepspeedStrategy)


#: module -> its device patch, run right after the module is first imported in a worker.
DEVICE_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "openrlhf.utils.deepspeed.deepspeed": _strategy_module,
    "openrlhf.trainer.ppo_utils.replay_buffer": cpu_replay_buffer,
}

#: When set, every worker seeds torch's global RNG with it first. OpenRLHF's prompt loader shuffles
#: from that RNG without a generator of its own (``--train.seed`` does not reach it), so without it
#: two launches order the prompts differently; set it to compare two runs on the same prompts.
SEED = "FORKRL_CPU_SEED"


def worker_patches() -> dict[str, Callable[[ModuleType], None]]:
    """Every patch a worker registers: :data:`DEVICE_PATCHES` and the rollout's weight sync
    (:data:`forkrl.plugins.openrlhf.cpu_rollout.WORKER_PATCHES`)."""
    from .cpu_rollout import WORKER_PATCHES

    overlap = DEVICE_PATCHES.keys() & WORKER_PATCHES.keys()
    if overlap:
        raise AssertionError(f"{sorted(overlap)} are patched twice: one patch per module")
    return {**DEVICE_PATCHES, **WORKER_PATCHES}


def apply_worker() -> None:
    """Ray's ``worker_process_setup_hook``: register :func:`worker_patches` in this worker process
    (and seed torch's global RNG when :data:`SEED` is set)."""
    if os.environ.get(SEED):
        import torch

        torch.manual_seed(int(os.environ[SEED]))
    pending = {}
    for name, patch in worker_patches().items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            pending[name] = patch
    if pending:
        sys.meta_path.insert(0, _AfterImport(pending))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the patched modules as the normal path finder does, and runs each one's patch right after
    the module's own code (once: the entry is dropped when found)."""

    def __init__(self, pending: dict[str, Callable[[ModuleType], None]]) -> None:
        self.pending = pending

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self.pending.pop(fullname, None)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # this module's own loader instance
        return spec
