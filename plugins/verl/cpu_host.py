"""What veRL 0.9.1's own ``python -m verl.trainer.main_ppo`` needs to run on a CPU machine, for CPU
smoke runs (:mod:`forkrl.plugins.verl.cpu_run`) and forkrl's end-to-end tests; not for training.

Importing this module installs it: :mod:`.cpu_run` names it in ``VERL_USE_EXTERNAL_MODULES``,
which veRL imports in every process (the driver, the TaskRunner, every Ray worker), so the run is
veRL's entry point, trainer, workers, TransferQueue, agent loop, reward loop and weight sync,
unchanged. Nothing else imports it: no ordinary veRL run sees any of this. What it changes, and
why none of it can change the training math:

- **The device platform** (:class:`forkrl.plugins.verl.cpu_platform.CPUPlatform`, registered as
  ``forkrl_cpu`` and selected by ``VERL_PLATFORM``): device queries answered for the CPU, gloo as
  the collective backend. No kernel changes.
- **The process-group backend string**: veRL asks for ``"cpu:gloo,<device>:<collective backend>"``,
  which on this platform reads ``"cpu:gloo,cpu:gloo"`` and torch refuses as a duplicate. The
  duplicate is dropped; the group is the same gloo group veRL would get. (Can go when veRL builds
  the string without duplicates.)
- **Pinned memory for the reference's parameter offload**: veRL gives the FSDP2 reference
  ``CPUOffloadPolicy(pin_memory=True)``, and a CPU-only torch cannot pin. Pinning only speeds up
  host-to-device copies, of which a CPU machine has none: the policy is the same without it.
- **The rollout backend** ``hf_cpu`` (:mod:`forkrl.plugins.verl.cpu_rollout`): Hugging Face
  ``generate`` in place of vLLM, which does not serve on a CPU. It makes the rollouts; the training
  step is untouched.

Checked with veRL 0.9.1 (the version forkrl pins; another version gets a warning).
"""

from __future__ import annotations

import functools
import logging
import sys

import torch.distributed
import torch.distributed.fsdp

from . import cpu_platform
from .cpu_run import ROLLOUT

__all__ = ["install"]

logger = logging.getLogger(__name__)

#: The veRL version these stand-ins were checked with.
CHECKED = "0.9.1"

#: Where veRL's hybrid actor worker finds the rollout's adapter (veRL imports it by this path).
ADAPTER = "forkrl.plugins.verl.cpu_rollout.HFServerAdapter"


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


def _load_replica():
    # At first use: cpu_rollout imports veRL, whose import is what loads this module.
    from .cpu_rollout import HFReplica

    return HFReplica


def install() -> None:
    """Register the platform and the ``hf_cpu`` rollout, patch the process group and the offload
    policy (idempotent)."""
    from verl import __version__  # set before veRL imports its external modules (this one)

    if __version__ != CHECKED:
        logger.warning(
            "forkrl's CPU stand-ins were checked with veRL %s; this is veRL %s", CHECKED, __version__
        )
    cpu_platform.register()
    if not getattr(torch.distributed.init_process_group, "forkrl_cpu_host", False):
        torch.distributed.init_process_group = _dedupe_backend(torch.distributed.init_process_group)
    torch.distributed.fsdp.CPUOffloadPolicy = UnpinnedOffloadPolicy
    for name in ("verl.utils.fsdp_utils", "verl.workers.engine.fsdp.transformer_impl"):
        if name in sys.modules:  # imported before this module: patch their names too
            sys.modules[name].CPUOffloadPolicy = UnpinnedOffloadPolicy

    from verl.workers.rollout import base, replica

    base._ROLLOUT_REGISTRY[(ROLLOUT, "async")] = ADAPTER
    replica.RolloutReplicaRegistry.register(ROLLOUT, _load_replica)


install()
