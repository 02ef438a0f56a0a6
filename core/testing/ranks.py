"""Multi-process test runs: a module-level function on N gloo ranks, returning its results as data.

:func:`run_on_ranks` runs ``fn(*args, **kwargs)`` in ``world_size`` new processes with torchrun's
launcher variables set (a free local port), a gloo group started (unless the host code starts its
own), and returns each rank's return value, in rank order. ``fn`` and its arguments
travel by pickle, so ``fn`` is a module-level function (in a test module, or beside it) and the
results are plain data: no script in a string, no parsing of printed lines. A rank that raises
fails the call with that rank's traceback; the other ranks are stopped (they may be waiting in a
collective the failed rank never reached). :func:`run_in_subprocess` runs a function once in a
new process without launcher variables (the one-process run a multi-rank run is compared with).

The processes fork from a server (multiprocessing's ``forkserver``) that has imported forkrl's core
and the heavy libraries this process had imported (:data:`PRELOAD`), none of them started: a
fresh interpreter spends about 5 s of CPU importing them, more than many ranks' work. Each process
then takes the call's environment whole (this one's, without its launcher variables, plus the
rank's), working directory, ``sys.path`` and thread count, and imports ``fn``'s module itself.

A test process may itself hold a one-rank gloo group (a host's test support starts one:
:func:`forkrl.core.testing.group.start_gloo`), so the ranks it launches get an environment without
its launcher variables and start their own group.
:func:`torchrun` runs a script file under torchrun (a host whose own launcher must start the ranks);
such a script ends with :func:`finish`: a process group still alive at interpreter exit can abort
the process (SIGABRT) after its work has passed.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .group import free_port

__all__ = [
    "LAUNCHER_ENV",
    "RankFailed",
    "clean_env",
    "finish",
    "report",
    "run_in_subprocess",
    "run_on_ranks",
    "torchrun",
]

#: The variables torchrun sets for its ranks (and :func:`~forkrl.core.testing.group.start_gloo` for one rank).
LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)


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


#: Libraries the rank server imports when this process has (with forkrl's core, always): what a
#: rank's module would import anyway, imported once. None starts a Python thread, a process group,
#: Ray or an engine on import, so the server forks cleanly.
PRELOAD = ("torch", "transformers", "accelerate", "peft", "datasets", "deepspeed", "trl", "verl", "openrlhf")


def _server() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's forkserver context; its server (one per process, started by the first rank)
    imports forkrl's core and the :data:`PRELOAD` libraries this process has imported by then (a
    test session has imported every test module's by its first test)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["forkrl.core", *(m for m in PRELOAD if m in sys.modules)])
    return ctx


class RankFailed(AssertionError):
    """A rank of :func:`run_on_ranks` raised (or died, or hung); the message carries its traceback."""


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    init_group: bool = True,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks and return each rank's result.

    Each rank is a new process (one OpenMP thread unless ``env`` says otherwise) with
    torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT`` on a free port); with ``init_group`` it joins a gloo group before ``fn`` runs,
    unless importing ``fn``'s module started one (leave it off when the host code under test starts
    the group from those variables: accelerate, DeepSpeed, a host's test support started inside
    ``fn``). After ``fn`` returns, every rank waits for the others and the group is
    destroyed.

    Args:
        fn: a module-level function (pickled by reference); ``args``/``kwargs`` and its result
            must pickle.
        world_size: the number of ranks.
        init_group: start a gloo group (``env://``) before calling ``fn``.
        timeout: seconds for the whole run; a hang fails with :class:`RankFailed`.
        env: extra environment variables for every rank.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        RankFailed: when a rank raised (its traceback), died, or the run timed out.
    """
    port = str(free_port())
    envs = [
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            **(env or {}),
        }
        for rank in range(world_size)
    ]
    return _launch(fn, args, kwargs, envs, init_group, timeout)


def run_in_subprocess(
    fn: Callable[..., Any], *args: Any, timeout: float = 600, env: dict[str, str] | None = None, **kwargs: Any
) -> Any:
    """Run ``fn(*args, **kwargs)`` once in a new process without launcher variables (no
    process group; one OpenMP thread unless ``env`` says otherwise) and return its result.

    Raises:
        RankFailed: when it raised (its traceback), died, or timed out.
    """
    return _launch(fn, args, kwargs, [dict(env or {})], False, timeout)[0]


def _launch(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    envs: list[dict[str, str]],
    init_group: bool,
    timeout: float,
) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="forkrl-ranks-") as tmp:
        work = Path(tmp)
        call = work / "call.pkl"
        # sys.path travels first and on its own: unpickling fn imports its module (a test module
        # is importable only from the paths pytest added).
        call.write_bytes(pickle.dumps((list(sys.path), pickle.dumps((fn, args, kwargs, init_group)))))
        ctx, procs = _server(), []
        for rank, extra in enumerate(envs):
            env = clean_env(**{"OMP_NUM_THREADS": "1", **extra})
            paths = (str(call), str(work / f"{rank}.result"), str(work / f"{rank}.log"))
            procs.append(
                ctx.Process(target=_rank_process, args=(*paths, env, os.getcwd()), name=f"rank{rank}")
            )
            procs[-1].start()
        try:
            failure = _wait(procs, work, time.monotonic() + timeout)
        finally:
            for proc in procs:
                if proc.exitcode is None:
                    proc.kill()
                proc.join()
        if failure is not None:
            raise RankFailed(failure)
        results = []
        for rank in range(len(envs)):
            _, value = pickle.loads((work / f"{rank}.result").read_bytes())
            results.append(value)
        return results


def _wait(procs: list, work: Path, deadline: float) -> str | None:
    """Wait for every rank; the first failure (a raised exception, a death, the deadline) as text.

    Of ranks that raised, the one whose result was written first is reported: a rank's error makes
    the others fail in their next collective, and those may exit before the parent looks.
    """
    while True:
        running = False
        raised = []
        for rank, proc in enumerate(procs):
            code = proc.exitcode
            result = work / f"{rank}.result"  # written whole (a rename), read even before the rank exits
            if result.exists():
                ok, value = pickle.loads(result.read_bytes())
                if not ok:
                    raised.append((result.stat().st_mtime_ns, rank, value))
            if code is None:
                running = True
            elif not result.exists():
                log = _tail(work / f"{rank}.log", 4000)
                return (
                    f"rank {rank} of {len(procs)} exited with {code} and no result; its output ends:\n{log}"
                )
        if raised:
            _, rank, value = min(raised)
            return f"rank {rank} of {len(procs)} raised:\n{value}"
        if not running:
            return None
        if time.monotonic() > deadline:
            logs = "\n".join(
                f"--- rank {rank}:\n" + _tail(work / f"{rank}.log", 2000) for rank in range(len(procs))
            )
            return f"the ranks did not finish in time (a hang?); their output ends:\n{logs}"
        time.sleep(0.05)


def _tail(log: Path, chars: int) -> str:
    """The end of a rank's output; empty when the rank died before it opened its log."""
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def _rank_process(call_path: str, result_path: str, log_path: str, env: dict[str, str], cwd: str) -> None:
    """A rank, forked from the server: its output to ``log_path``, ``env`` as its whole environment,
    ``cwd``, the thread count ``OMP_NUM_THREADS`` asks for (the server's OpenMP read it at start),
    then :func:`_rank_main`."""
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # _launch always sets it
    _rank_main(call_path, result_path)


def _rank_main(call_path: str, result_path: str) -> None:
    """One rank of :func:`_launch`: run the call, write ``(ok, result or traceback)``, and end
    without the interpreter's teardown (see :func:`finish`)."""
    import traceback

    sys_path, call = pickle.loads(Path(call_path).read_bytes())
    sys.path[:] = sys_path
    try:
        fn, args, kwargs, init_group = pickle.loads(call)
        if init_group:
            import torch.distributed as dist

            if not dist.is_initialized():  # fn's module may have started it
                dist.init_process_group("gloo")
        outcome = (True, fn(*args, **kwargs))
    except BaseException:  # noqa: BLE001 (every failure goes back to the parent, as text)
        outcome = (False, traceback.format_exc())
    tmp = Path(result_path + ".tmp")
    tmp.write_bytes(pickle.dumps(outcome))
    tmp.rename(result_path)  # whole or absent: the parent may read it while this rank still runs
    if not outcome[0]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no barrier: the other ranks may never reach it; the parent stops them
    finish()
