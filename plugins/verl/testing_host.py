"""Loaded by veRL in every process of a test's or benchmark's end-to-end run
(:data:`forkrl.plugins.verl.testing_e2e.HOST_MODULE`, after forkrl's own :mod:`.cpu_host`): the
``hf_cpu`` rollout re-registered with its recording server
(:class:`~forkrl.plugins.verl.testing_e2e.RecordingReplica`), so that each sample reaches the
rollout log. Everything else of the CPU run is the product's. No ordinary run loads it.
"""

from __future__ import annotations

from verl.workers.rollout import replica

from .cpu_run import ROLLOUT


def _load_replica():
    from .testing_e2e import RecordingReplica  # at first use: it imports veRL, whose import loads this

    return RecordingReplica


replica.RolloutReplicaRegistry.register(ROLLOUT, _load_replica)
