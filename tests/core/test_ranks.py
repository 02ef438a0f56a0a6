"""The multi-rank runner the distributed tests use: results come back as data in rank order, a
rank's exception fails the run with that rank's traceback (the other ranks are stopped, not left
waiting in a collective), and a hang fails at the timeout."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from forkrl.core.testing.group import free_port
from forkrl.core.testing.ranks import RankFailed, run_in_subprocess, run_on_ranks

pytestmark = pytest.mark.slow  # starts several processes per test


def _sum_of_ranks(scale: float, *, offset: int = 0) -> dict:
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item() * scale}


def _rank_one_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one disagrees")
    dist.barrier()  # rank 0 waits here for a rank that never comes


def _sleeps() -> None:
    import time

    time.sleep(60)


def _launcher_env() -> dict:
    import os

    return {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}


def test_results_come_back_in_rank_order():
    got = run_on_ranks(_sum_of_ranks, 2, 2.0, offset=1, timeout=120)
    assert got == [{"rank": r, "world": 2, "sum": 6.0} for r in range(2)]


def test_a_rank_that_raises_fails_the_run_with_its_traceback():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 raised.*ValueError: rank one disagrees"):
        run_on_ranks(_rank_one_raises, 2, timeout=120)


def test_a_hang_fails_at_the_timeout():
    with pytest.raises(RankFailed, match="did not finish in time"):
        run_on_ranks(_sleeps, 2, init_group=False, timeout=3)


def test_one_process_runs_without_launcher_variables():
    assert run_in_subprocess(_launcher_env) == {"RANK": None, "WORLD_SIZE": None, "OMP_NUM_THREADS": "1"}


def _dies() -> None:
    """Rank 0 dies; rank 1 returns (were both to die, which one the parent saw first would be a race)."""
    import os

    if os.environ["RANK"] == "0":
        print("about to die", flush=True)
        os._exit(3)


def _threads_and(name: str) -> tuple[int, str | None]:
    import os

    return torch.get_num_threads(), os.environ.get(name)


def test_a_rank_that_dies_fails_the_run_with_its_output():
    with pytest.raises(RankFailed, match=r"(?s)rank 0 of 2 exited with 3 and no result.*about to die"):
        run_on_ranks(_dies, 2, init_group=False, timeout=120)


def test_each_call_gets_its_own_environment_and_thread_count(monkeypatch):
    """The ranks fork from one server started by an earlier call: each still gets the environment
    of its own call (a variable set since) and the thread count that environment asks for."""
    run_in_subprocess(_threads_and, "X")  # the server is running
    monkeypatch.setenv("FORKRL_RANKS_PROBE", "set after the server started")
    assert run_in_subprocess(_threads_and, "FORKRL_RANKS_PROBE") == (1, "set after the server started")
    assert run_in_subprocess(_threads_and, "FORKRL_RANKS_PROBE", env={"OMP_NUM_THREADS": "2"})[0] == 2


def test_a_free_port_is_bindable_and_outside_the_ephemeral_range():
    """Ports the kernel hands out to outgoing connections (and to ``bind(0)``) are the ones another
    process beside a test can take before its rank listens."""
    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1 and not any(low <= p <= high for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
