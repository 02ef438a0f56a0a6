"""True float64 for exactness checks, and the bf16 criterion of the precision tests."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Float64Mode", "Bf16Rounding"]


class Bf16Rounding:
    """One quantity (all log-probs, or a whole parameter update) computed three ways: stock in
    float32 (``exact``), stock in bf16 (``stock``), the tree in bf16 (``tree``); flat tensors.

    ``gap = |stock - exact|``. ``off``: ``|tree - exact| / gap``; ``near``: ``|tree - stock| / gap``.
    Under bf16 autocast over float32 weights the tree must be a bf16 computation as accurate as
    stock (:meth:`check_follows`: ``0.5 <= off <= 1.5``); with bf16 weights, whose rounding
    dominates, within half the gap of stock (:meth:`check_within_half`).
    """

    def __init__(self, label: str, tree: torch.Tensor, stock: torch.Tensor, exact: torch.Tensor) -> None:
        self.label = label
        tree, stock, exact = (t.detach().double().flatten().cpu() for t in (tree, stock, exact))
        self.gap = float((stock - exact).norm())
        assert self.gap > 0, f"{label}: bf16 stock equals float32 stock (nothing was rounded)"
        self.off = float((tree - exact).norm()) / self.gap
        self.near = float((tree - stock).norm()) / self.gap

    def check_follows(self, near: float | None = None) -> None:
        """``0.5 <= off <= 1.5`` (and ``near`` below the bound given)."""
        assert 0.5 <= self.off <= 1.5 and (near is None or self.near < near), (
            f"{self.label}: |tree - fp32| {self.off:.3f}, |tree - stock| {self.near:.3f} of |stock_bf16 - fp32| "
            f"(want 0.5 .. 1.5{'' if near is None else f' and < {near}'})"
        )

    def check_within_half(self) -> None:
        """``near < 0.5`` (the OpenRLHF bf16 criterion)."""
        assert self.near < 0.5, f"{self.label}: |tree - stock_bf16| {self.near:.3f} of the gap (want < 0.5)"


def _promote(x):
    if x is torch.float32:
        return torch.float64
    return x


class Float64Mode(TorchFunctionMode):
    """Map every float32 request to float64 (``.float()``, ``.to(torch.float32)``, ``dtype=float32``).

    transformers casts RMSNorm, eager softmax and RoPE to float32 even in a float64 model, which
    stops cross-path agreement near 1e-7; under this mode a float64 model stays float64 throughout.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            func, args = torch.Tensor.to, (args[0], torch.float64)
        elif func is torch.Tensor.to or func is torch.Tensor.type:
            args = tuple(_promote(a) for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = _promote(kwargs["dtype"])
        return func(*args, **kwargs)
