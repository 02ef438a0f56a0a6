"""Running a host's launcher as a user would, from a test or a benchmark: in a fresh process and a
process session of its own, so that a run past its time limit is killed with everything it started
(Ray's GCS, raylet and workers), and its whole output is kept for the assertion message.

The rollout log: where a run's recording rollout (veRL's :mod:`forkrl.plugins.verl.testing_host`;
OpenRLHF's own ``--rollout hf``, :data:`forkrl.plugins.openrlhf.cpu_rollout.ROLLOUT_LOG`) appends
every sample, so that two runs' rollouts can be compared sample by sample
(``benchmarks/learning_curve_hosts.py``). The end-to-end runs sample from the hosts' own vLLM engines
on vLLM's CPU build; a Hugging Face ``generate`` rollout with a recorder stands in only where a run
must see the same rollouts twice (the resume pairs, the learning-curve benchmark): vLLM's samples
depend on how its scheduler batches the requests, the stand-in's on the weights and prompt alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ROLLOUT_LOG", "record_rollout", "run_launcher"]


def run_launcher(
    cmd: Sequence[str], *, env: dict[str, str], cwd: str | Path, timeout: float
) -> tuple[int, str, float]:
    """``cmd`` to completion or ``timeout`` seconds; returns ``(returncode, stdout+stderr, seconds)``.

    Raises:
        TimeoutError: past ``timeout`` (the session is killed first), with the output's end.
    """
    start = time.monotonic()
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd[:4])} ran past {timeout:.0f} s:\n{log[-4000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, log, time.monotonic() - start


#: Where a recording rollout appends each sample it makes, one JSON line ``{"load", "prompt", "tokens"}``
#: (``load``: the weight syncs it has had), when this variable names a file.
ROLLOUT_LOG = "FORKRL_E2E_ROLLOUT_LOG"


def record_rollout(load: int, prompt: list[int], tokens: list[int]) -> None:
    """Append one sample to the file :data:`ROLLOUT_LOG` names (nothing when it is unset)."""
    path = os.environ.get(ROLLOUT_LOG)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"load": load, "prompt": list(prompt), "tokens": list(tokens)}) + "\n")
