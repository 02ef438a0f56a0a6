"""forkrl's exception types (every one a ``ValueError`` subclass: bad input or configuration)."""

from __future__ import annotations

__all__ = ["UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """The model cannot run on a prefix tree in the requested mode; the message names the alternative."""
