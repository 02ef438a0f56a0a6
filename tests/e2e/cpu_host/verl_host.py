"""Test-only: loaded by veRL in every process of an end-to-end run after forkrl's own CPU module
(``python -m forkrl.plugins.verl.cpu_run`` puts :mod:`forkrl.plugins.verl.cpu_host` first in
``VERL_USE_EXTERNAL_MODULES``, this after it): the ``hf_cpu`` rollout is re-registered with its
recording server (:mod:`.verl_rollout`), so that each sample reaches the rollout log. Everything
else of the CPU run is the product's.

Nothing in ``core/`` or ``plugins/`` imports this package.
"""

from __future__ import annotations

from verl.workers.rollout import replica

from forkrl.plugins.verl.cpu_run import ROLLOUT


def _load_replica():
    from .verl_rollout import RecordingReplica  # at first use: it imports veRL, whose import loads this

    return RecordingReplica


replica.RolloutReplicaRegistry.register(ROLLOUT, _load_replica)
