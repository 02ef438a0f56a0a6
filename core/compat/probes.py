"""The two checks most :class:`~forkrl.core.compat.Private` probes make of a host's code.

A plugin relies on a host function's parameters (it calls or overrides it) and on lines of its
source (what it sets, in which order, with which arguments). :func:`takes` and :func:`reads` assert
those and say in the failure which function changed and what is missing, so each host's
``compat`` states only what it relies on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .registry import parameter_names

__all__ = ["reads", "takes"]


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__


def takes(fn: Callable, *names: str, exact: bool = False) -> None:
    """Assert that ``fn``'s parameters begin with ``names``, in order (with ``exact``: are them).

    Raises:
        AssertionError: naming the function, its parameters and the ones expected.
    """
    got = parameter_names(fn)
    seen = got if exact else got[: len(names)]
    assert seen == list(names), (
        f"{_name(fn)} takes {got}, expected {'' if exact else 'to begin with '}{list(names)}"
    )


def reads(obj: Any, *needles: str) -> str:
    """Assert that the source of ``obj`` (a module, class or function) holds every one of ``needles``;
    return the source (for checks of order).

    Raises:
        AssertionError: naming ``obj`` and the needles it no longer holds.
    """
    src = inspect.getsource(obj)
    missing = [n for n in needles if n not in src]
    assert not missing, f"{_name(obj)} no longer holds {missing}"
    return src
