"""Test-only: forkrl's ``hf_cpu`` rollout (:mod:`forkrl.plugins.verl.cpu_rollout`, the one CPU smoke
runs use) with every sample appended to the rollout log (:func:`tests.e2e.cpu_host.record_rollout`,
which the learning-curve benchmark reads). Sampling is the product's, unchanged."""

from __future__ import annotations

from forkrl.plugins.verl.cpu_rollout import HFReplica, HFServer
from tests.e2e.cpu_host import record_rollout


class RecordingServer(HFServer):
    """:class:`HFServer` that records each sample with the number of weight syncs it has had."""

    def sampled(self, prompt_ids: list[int], tokens: list[int]) -> None:
        record_rollout(self.weight_syncs, prompt_ids, tokens)


class RecordingReplica(HFReplica):
    server_class = RecordingServer
