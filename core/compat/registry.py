"""The one registry form of every host or library private forkrl relies on: :class:`Private`.

Core and every plugin name each private they rely on as a :class:`Private`: the library it belongs
to, its attribute path, what forkrl does with it and why, the versions it was read from, and a
probe that fails when it is gone or changed. Each package keeps its entries in its own
``compat`` (``PRIVATES``: core's by area, gathered in :mod:`forkrl.core.compat`) and one contract
test per host iterates them, so an upgrade that
moves one fails in one place with a message naming what changed in the host and what relies on it.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

__all__ = ["CHECKED", "Private", "function_source", "parameter_names"]

#: The versions every core entry was read from and tested against.
CHECKED = "torch 2.13.0, transformers 5.25.0"


@dataclass(frozen=True)
class Private:
    """One private of a host or library that forkrl relies on.

    Attributes:
        host: the library it belongs to (``"transformers"``, ``"torch"``, ``"TRL"``, ``"veRL"``, ...).
        name: its attribute path (dotted), or the fact about the host's code that is relied on.
        why: what forkrl does with it, and what breaks without it.
        probe: raises (AttributeError, AssertionError, ...) when the private is gone or changed.
        checked: the versions it was read from and tested against.
    """

    host: str
    name: str
    why: str
    probe: Callable[[], None]
    checked: str

    def check(self) -> None:
        """Run the probe; any failure becomes an AssertionError that says what changed in the host,
        what forkrl relies on it for, and the versions it was checked against."""
        try:
            self.probe()
        except Exception as err:  # noqa: BLE001 - any breakage names the entry
            raise AssertionError(
                f"{self.host} changed: {self.name} is gone or no longer as forkrl expects "
                f"({type(err).__name__}: {err}); forkrl relies on it: {self.why} "
                f"(checked against {self.checked})"
            ) from err


def parameter_names(fn: Callable) -> list[str]:
    """The names of ``fn``'s parameters, in order (what a private's check compares).

    A module-level function that transformers wrapped into a module (5.25's hub-kernel fallback
    wrapper for the Mamba kernels: an ``nn.Module`` instance whose ``forward`` is the function) is read
    through its ``forward``: the arguments the callers pass are the same.
    """
    if isinstance(fn, nn.Module):
        return [n for n in inspect.signature(type(fn).forward).parameters][1:]  # without self
    return list(inspect.signature(fn).parameters)


def function_source(module, name: str) -> str:
    """The source of module-level function ``name`` of ``module`` (from ``def``, without decorators),
    read from the module's own source: from 5.25 transformers (with the ``kernels`` package it
    depends on) replaces some of them by a module instance (``kernels``' ``use_kernel_forward_from_hub``
    on a function), whose class ``inspect`` cannot locate."""
    text = inspect.getsource(module)
    node = next(
        n
        for n in ast.parse(text).body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
    )
    return ast.get_source_segment(text, node)
