"""Running a host's launcher as a user would, from a test: in a fresh process and a process session of
its own, so that a run past its time limit is killed with everything it started (Ray's GCS, raylet and
workers), and its whole output is kept for the assertion message."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


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
