"""Test-only CPU stand-ins for the hosts' GPU-only parts (rollout servers, device patches) so that their real
launchers run end to end on a CPU machine in CI; nothing in core/ or plugins/ imports it."""

import json
import os

#: Where a stand-in rollout appends each sample it makes, one JSON line ``{"load", "prompt", "tokens"}``
#: (``load``: the weight syncs it has had), when this variable names a file; the learning-curve
#: benchmark compares two runs' rollouts with it.
ROLLOUT_LOG = "FORKRL_E2E_ROLLOUT_LOG"


def record_rollout(load: int, prompt: list[int], tokens: list[int]) -> None:
    """Append one sample to the file :data:`ROLLOUT_LOG` names (nothing when it is unset)."""
    path = os.environ.get(ROLLOUT_LOG)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"load": load, "prompt": list(prompt), "tokens": list(tokens)}) + "\n")
