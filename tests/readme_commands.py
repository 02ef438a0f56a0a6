"""The README's complete host commands, as argument lists (the tests parse them with each host's
own parser or Hydra config: a newcomer pastes them unchanged)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def command(prefix: str, substitutions: dict[str, str] | None = None) -> list[str]:
    """The README's complete fenced command starting with ``prefix`` (one without ``<placeholders>``; continuation lines joined,
    ``substitutions`` applied, ``$HOME`` expanded), split as a shell would.

    Raises:
        AssertionError: when the README has no such command, or more than one.
    """
    blocks, block, fenced = [], [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            if fenced and block:
                blocks.append(" ".join(part.rstrip("\\").strip() for part in block))
            fenced, block = not fenced, []
        elif fenced:
            block.append(line)
    found = [b for b in blocks if b.startswith(prefix) and "<" not in b]
    assert len(found) == 1, f"the README has {len(found)} commands starting with {prefix!r}"
    text = found[0]
    for old, new in (substitutions or {}).items():
        text = text.replace(old, new)
    return shlex.split(text.replace("$HOME", os.path.expanduser("~")))
