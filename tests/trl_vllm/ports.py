"""What the TRL + vLLM tests' runs share: a free ``MASTER_PORT``."""

from __future__ import annotations

import os

from forkrl.core.testing.group import free_port


def free_port_env() -> dict[str, str]:
    """This environment with ``MASTER_PORT`` on a free port: TRL's colocated engine joins a one-rank
    group at ``MASTER_PORT`` (else 29500), and scripts/test.sh runs other suites beside this one."""
    return {**os.environ, "MASTER_PORT": str(free_port())}
