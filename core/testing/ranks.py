"""Multi-process test runs: launching local ranks, and ending a rank's script cleanly.

A test process may itself hold a one-rank gloo group (host harnesses initialise one), so the ranks
it launches get an environment without torchrun's launcher variables and start their own group.
A rank's script ends with :func:`finish`: a process group still alive at interpreter exit can
abort the process (SIGABRT) after its work has passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["LAUNCHER_ENV", "clean_env", "finish", "rank_lines", "report", "torchrun"]

#: The variables torchrun sets for its ranks (and a one-rank harness sets for itself).
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without :data:`LAUNCHER_ENV`, with ``extra`` set."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV} | extra


def torchrun(
    script: str | Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 600,
    cwd: str | Path | None = None,
    module: bool = False,
    **env: str,
) -> subprocess.CompletedProcess:
    """Run ``script args`` (with ``module``, ``-m script args``) on ``nproc`` local ranks
    (``torchrun --standalone``, one OpenMP thread each unless ``env`` says otherwise); a hang is a
    ``TimeoutExpired`` after ``timeout`` seconds.

    Raises:
        AssertionError: when the run fails, with the end of its stderr.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    proc = subprocess.run(
        [*cmd, *(["-m"] if module else []), str(script), *map(str, args)],
        capture_output=True,
        text=True,
        env=clean_env(**{"OMP_NUM_THREADS": "1", **env}),
        timeout=timeout,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def rank_lines(stdout: str, prefix: str = "RANK") -> list[str]:
    """The lines of ``stdout`` the ranks reported (starting with ``prefix``)."""
    return [line for line in stdout.splitlines() if line.startswith(prefix)]


def report(*lines: str) -> None:
    """Print every rank's ``lines`` from rank 0, in rank order (the ranks' own prints would
    interleave); a collective: every rank calls it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        print("\n".join(lines), flush=True)
        return
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(lines))
    if dist.get_rank() == 0:
        print("\n".join(line for part in gathered for line in part), flush=True)


def finish() -> None:
    """End a rank's script: wait for every rank, destroy the process group (if any), and exit.

    The exit skips the interpreter's teardown (``os._exit`` after flushing): everything was
    reported, and a script that kept autograd graphs or FSDP state alive across a deliberate
    failure was seen to abort there under load (``terminate called without an active exception``
    from a C++ thread destroyed at interpreter exit), failing a run whose results were all in.
    """
    import os
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
