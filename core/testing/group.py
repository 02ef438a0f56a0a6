"""The process group a host's in-process test support trains in: gloo, the ranks a launcher described
(torchrun, :func:`~forkrl.core.testing.ranks.run_on_ranks`), else this process alone."""

from __future__ import annotations

import os
import random
import socket

__all__ = ["free_port", "start_gloo"]

#: Below the kernel's ephemeral range (Linux: 32768-60999) and above Ray's worker ports (10002-19999).
_PORTS = range(20000, 32768)


def free_port() -> int:
    """A local TCP port nobody listens on now, for a process that will listen on it soon.

    Not ``bind(0)``: that port comes from the ephemeral range, where every outgoing connection of
    the processes beside this one (Ray, vLLM, another suite's ranks: scripts/test.sh runs three
    suites side by side) also takes its local port, so one of them can take it before the listener
    starts (seen: ``EADDRINUSE`` in a rank's TCPStore). Here a random port below that range."""
    rng = random.Random(os.urandom(8))
    for _ in range(64):
        port = rng.choice(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free local port in {_PORTS.start}-{_PORTS.stop - 1} after 64 tries")


def start_gloo() -> None:
    """Start this process's gloo group unless one is running (idempotent). Without a launcher's
    variables it is one rank on a free local port (the variables are set for it, as torchrun would)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for key, value in dict(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo")
