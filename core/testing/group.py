"""The process group a host's in-process test support trains in: gloo, the ranks a launcher described
(torchrun, :func:`~forkrl.core.testing.ranks.run_on_ranks`), else this process alone."""

from __future__ import annotations

import os
import socket

__all__ = ["start_gloo"]


def start_gloo() -> None:
    """Start this process's gloo group unless one is running (idempotent). Without a launcher's
    variables it is one rank on a free local port (the variables are set for it, as torchrun would)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for key, value in dict(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("gloo")
