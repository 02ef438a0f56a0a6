"""True float64 for exactness checks."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Float64Mode"]


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
