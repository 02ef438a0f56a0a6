"""forkrl's exception types (every one a ``ValueError`` subclass: bad input or configuration)."""

from __future__ import annotations

__all__ = ["UnsupportedModelError"]

# How core messages name the way out in host-neutral words; a plugin says it in its host's words.
_GENERIC_WAY_OUT = ("train this model without tree_packing", "train without tree_packing")


class UnsupportedModelError(ValueError):
    """The model cannot run on a prefix tree in the requested mode; the message names the alternative."""

    def for_host(self, way_out: str) -> UnsupportedModelError:
        """This error with the way out said once, in the host's words (``way_out``, e.g. "turn
        tree_packing off"): it replaces the core's generic phrase, or is appended where the core
        named only other alternatives."""
        msg = str(self)
        for phrase in _GENERIC_WAY_OUT:
            if phrase in msg:
                return UnsupportedModelError(msg.replace(phrase, way_out))
        return UnsupportedModelError(f"{msg}; or {way_out}")
