"""scripts/setup.sh installs with uv, which reads no pip configuration: scripts/uv_args.py passes pip's on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALWAYS = ["--index-strategy", "unsafe-best-match", "--compile-bytecode"]


def _uv_args(**pip_env: str) -> list[str]:
    """scripts/uv_args.py's lines under only ``pip_env``'s pip settings (no pip config file is read)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, **pip_env)
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "uv_args.py")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.splitlines()


def test_pips_indexes_find_links_constraints_and_certificate_reach_uv(tmp_path):
    constraints = tmp_path / "c.txt"
    constraints.write_text("torch<=2.14.1\n")
    args = _uv_args(
        PIP_INDEX_URL="https://mirror.example/simple",
        PIP_EXTRA_INDEX_URL="https://a.example/simple https://b.example/simple",
        PIP_FIND_LINKS="/opt/wheels",
        PIP_CONSTRAINT=str(constraints),
        PIP_CERT="/etc/ssl/bundle.pem",
    )
    assert args == [
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "https://a.example/simple",
        "--extra-index-url", "https://b.example/simple",
        "--find-links", "/opt/wheels",
        "--constraint", str(constraints),
        "SSL_CERT_FILE=/etc/ssl/bundle.pem",
        *ALWAYS,
    ]  # fmt: skip


def test_pypi_is_not_passed_so_a_uv_configuration_of_ones_own_stands():
    assert _uv_args() == ALWAYS
    assert _uv_args(PIP_INDEX_URL="https://pypi.org/simple/") == ALWAYS
