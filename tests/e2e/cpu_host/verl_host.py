"""Test-only: what veRL 0.9.1's own ``python -m verl.trainer.main_ppo`` needs to run on a CPU machine.

veRL imports this module in every process (the driver, the TaskRunner, every Ray worker) through its
own ``VERL_USE_EXTERNAL_MODULES`` hook (``verl/__init__.py``), so the run is veRL's entry point,
trainer, workers, TransferQueue, agent loop, reward loop and weight sync, unchanged. What it replaces,
and why none of it can change the training math:

- **The device platform** (``tests/verl/cpu_platform.py``'s, selected with
  ``VERL_PLATFORM=forkrl_cpu_ray``): veRL knows nvidia/npu/rocm only. The CPU platform answers device
  queries (memory zeros, the current device "cpu", gloo as the collective backend). Tensors stay where
  torch puts them; no kernel changes. Its log-softmax/entropy upcast from half precision reproduces
  what veRL's GPU kernels compute and is a no-op in float32. Under Ray it claims the "GPU" resource,
  which the run declares (``ray_init.num_gpus``) so that veRL's placement groups can be scheduled.
- **The process-group backend string**: veRL asks for ``"cpu:gloo,<device>:<collective backend>"``,
  which on this platform reads ``"cpu:gloo,cpu:gloo"`` and torch refuses as a duplicate. The duplicate
  is dropped; the group is the same gloo group veRL would get.
- **Pinned memory for the reference's parameter offload**: veRL gives the FSDP2 reference
  ``CPUOffloadPolicy(pin_memory=True)``, and a CPU-only torch cannot pin. Pinning only speeds up
  host-to-device copies, of which a CPU machine has none: the policy is the same without it.
- **The rollout backend** ``hf_cpu`` (:mod:`.verl_rollout`): vLLM and SGLang cannot serve on a CPU, so a
  Ray actor samples with Hugging Face ``generate`` from the weights veRL syncs into it after every
  update. It produces the rollouts both runs train on; the training step (forkrl's or stock veRL's) is
  what the test checks, and both see rollouts made the same way.

Nothing in ``core/`` or ``plugins/`` imports this package.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")  # veRL registers its FSDP engines for cuda/npu only

import torch.distributed  # noqa: E402
import torch.distributed.fsdp  # noqa: E402
from verl.plugin.platform.platform_manager import PlatformRegistry  # noqa: E402

from tests.verl.cpu_platform import CPUPlatform  # noqa: E402

ROLLOUT = "hf_cpu"


@PlatformRegistry.register(platform="forkrl_cpu_ray")
class RayCPUPlatform(CPUPlatform):
    """The tests' CPU platform, placed by Ray on the declared (fake) "GPU" resource."""

    def ray_resource_name(self) -> str:
        return "GPU"


def _dedupe_backend(init_process_group):
    @functools.wraps(init_process_group)
    def init(*args, backend=None, **kwargs):
        if isinstance(backend, str) and "," in backend:
            parts = list(dict.fromkeys(backend.split(",")))
            backend = "gloo" if all(p.endswith("gloo") for p in parts) else ",".join(parts)
        return init_process_group(*args, backend=backend, **kwargs)

    init.forkrl_cpu_host = True
    return init


class UnpinnedOffloadPolicy(torch.distributed.fsdp.CPUOffloadPolicy):
    """FSDP2's CPU offload policy without pinned memory (asked for or not)."""

    def __init__(self, pin_memory: bool = False) -> None:
        super().__init__(pin_memory=False)


def install() -> None:
    """Patch the process group and the offload policy, register the ``hf_cpu`` rollout (idempotent)."""
    import sys

    if not getattr(torch.distributed.init_process_group, "forkrl_cpu_host", False):
        torch.distributed.init_process_group = _dedupe_backend(torch.distributed.init_process_group)
    torch.distributed.fsdp.CPUOffloadPolicy = UnpinnedOffloadPolicy
    for name in ("verl.utils.fsdp_utils", "verl.workers.engine.fsdp.transformer_impl"):
        if name in sys.modules:  # imported before this module: patch their names too
            sys.modules[name].CPUOffloadPolicy = UnpinnedOffloadPolicy

    from verl.workers.rollout import base, replica

    base._ROLLOUT_REGISTRY[(ROLLOUT, "async")] = "tests.e2e.cpu_host.verl_rollout.HFServerAdapter"
    replica.RolloutReplicaRegistry.register(ROLLOUT, _load_replica)


def _load_replica():
    from .verl_rollout import HFReplica  # at first use: verl_rollout imports verl, which imports this

    return HFReplica


install()
