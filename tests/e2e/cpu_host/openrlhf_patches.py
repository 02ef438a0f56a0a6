"""OpenRLHF's CPU stand-ins are forkrl's own CPU run (:mod:`forkrl.plugins.openrlhf.cpu_run`, with
:mod:`~forkrl.plugins.openrlhf.cpu_patches`, OpenRLHF's own vLLM engines on vLLM's CPU build through
:mod:`~forkrl.plugins.openrlhf.cpu_vllm`, and the Hugging Face rollout of
:mod:`~forkrl.plugins.openrlhf.cpu_rollout` where a test needs samples that depend on the weights and
prompts alone: the resume test, the learning-curve benchmark), which the end-to-end tests launch as
users do; this module keeps the name the learning-curve benchmark sets to seed every worker."""

from forkrl.plugins.openrlhf.cpu_patches import SEED as WORKER_SEED

__all__ = ["WORKER_SEED"]
