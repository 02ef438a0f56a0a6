"""Test-only CPU stand-ins for the hosts' GPU-only parts (rollout servers, device patches) so that their real
launchers run end to end on a CPU machine in CI; nothing in core/ or plugins/ imports it.

The end-to-end runs sample from the hosts' own vLLM engines on vLLM's CPU build. A Hugging Face
``generate`` rollout (the products' ``--rollout hf``, here with a recorder of its samples) stands in
only where a run must see the same rollouts twice: the resume pairs (veRL's tree run and its
resumed copy, OpenRLHF's) and ``benchmarks/learning_curve_hosts.py``, which compare a resumed or
forkrl run with another run sample for sample. vLLM's samples depend on how its scheduler batches
the requests, so a second run cannot reproduce them; the stand-in samples by prompt and position.
"""

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
