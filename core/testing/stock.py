"""Equals stock: a forkrl run's parameters against the unmodified host's, trained from the same
weights on the same data, measured against the size of stock's own update.

Each host's test support trains either side with the same entry point, ``train(..., forkrl: bool,
...)`` (stock host when ``forkrl`` is False): TRL's in ``tests/trl/trl_helpers.py``, OpenRLHF's in
:mod:`forkrl.plugins.openrlhf.testing` (and its ``parameters(trainer)``), veRL's in
:mod:`forkrl.plugins.verl.testing` (``train(worker, rollouts, ...)``, ``parameters(worker)``); the
comparison is this module's, for all three.

``relative = |tree - stock| / |stock - init|`` over all parameters, ``|.|`` either the largest
absolute entry (``norm="max"``) or the Euclidean norm of all entries together (``norm="l2"``).
Parameters are matched by name; one missing from ``init`` (a PEFT adapter, or a name PEFT prefixed)
is matched by name suffix, else starts from zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

__all__ = ["Norm", "assert_equals_stock", "relative_difference", "update_size"]

Norm = Literal["max", "l2"]
Parameters = Mapping[str, torch.Tensor]


def _initial(init: Parameters, name: str, like: torch.Tensor) -> torch.Tensor:
    """``init``'s parameter ``name`` (else the one whose name ends or extends it), else zeros."""
    key = name if name in init else next((k for k in init if name.endswith(k) or k.endswith(name)), None)
    if key is None or init[key].shape != like.shape:
        return torch.zeros_like(like)
    return init[key].detach()


def _size(diffs: list[torch.Tensor], norm: Norm) -> float:
    if norm == "max":
        return max(d.abs().max().item() for d in diffs)
    return float(torch.cat([d.flatten() for d in diffs]).norm())


def update_size(stock: Parameters, init: Parameters, norm: Norm = "max") -> float:
    """``|stock - init|``: how far the stock run moved the parameters."""
    return _size([p - _initial(init, n, p) for n, p in stock.items()], norm)


def relative_difference(stock: Parameters, tree: Parameters, init: Parameters, norm: Norm = "max") -> float:
    """``|tree - stock| / |stock - init|`` over ``stock``'s parameters.

    Raises:
        AssertionError: the stock run did not move the parameters (nothing to compare against).
    """
    change = update_size(stock, init, norm)
    assert change > 0, "the stock run did not change the parameters"
    return _size([tree[n] - p for n, p in stock.items()], norm) / change


def assert_equals_stock(
    stock: Parameters,
    tree: Parameters,
    init: Parameters,
    rtol: float,
    what: str = "forkrl's run",
    norm: Norm = "max",
) -> None:
    """``relative_difference(stock, tree, init, norm) < rtol``; the message gives the difference and
    the parameter that differs most."""
    rel = relative_difference(stock, tree, init, norm)
    if rel < rtol:
        return
    worst = max(stock, key=lambda n: (tree[n] - stock[n]).abs().max().item())
    raise AssertionError(
        f"{what} differs from stock by {rel:.2e} of the update ({norm} norm, want < {rtol:.0e}); most in "
        f"{worst}: max |tree - stock| {(tree[worst] - stock[worst]).abs().max().item():.2e}"
    )
