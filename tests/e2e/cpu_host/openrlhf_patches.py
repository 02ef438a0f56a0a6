"""OpenRLHF's CPU stand-ins are forkrl's own CPU run (:mod:`forkrl.plugins.openrlhf.cpu_run`, with
:mod:`~forkrl.plugins.openrlhf.cpu_patches` and :mod:`~forkrl.plugins.openrlhf.cpu_rollout`), which
the end-to-end tests launch as users do; this module keeps the name the learning-curve benchmark
sets to seed every worker."""

from forkrl.plugins.openrlhf.cpu_patches import SEED as WORKER_SEED

__all__ = ["WORKER_SEED"]
