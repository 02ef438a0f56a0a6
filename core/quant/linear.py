"""Weight-only round-to-nearest quantization with torch's own low-bit matmul kernels.

A :class:`QuantLinear` holds the quantized weight of one ``nn.Linear`` in the layout that torch's
kernels want and runs them:

- int4, groupwise (``group_size`` in 32/64/128/256 input features share one scale and zero point):
  ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (CPU) or ``_weight_int4pack_mm`` (CUDA), the
  "tinygemm" format in which a weight is ``(q - 8) * scale + zero`` with a 4-bit code ``q`` in 0..15.
- int8, one scale per output channel: ``torch.ops.aten._weight_int8pack_mm``, which takes exactly
  one scale per output row (there is no groupwise int8 kernel in torch), so int8 is per-channel.

Both kernels are vectorised for bfloat16 activations only (on this project's CPU the float32 path
of the same ops is 10-100x slower than a dense float32 matmul, the bfloat16 path 2-3x faster at one
row), so the layers compute in ``compute_dtype`` (bfloat16 by default) and cast their output back.

Where a kernel is missing for the device (or refuses the shape), the layer keeps the codes
unpacked and dequantizes on every call (``kernel == "dequant"``): correct, but not cheaper than
the dense layer. :attr:`QuantLinear.kernel` says which path a layer runs.
"""

from __future__ import annotations

import logging
from typing import Literal, get_args

import torch
from torch import nn

from .. import compat

logger = logging.getLogger(__name__)

__all__ = [
    "BITS",
    "DEFAULT_GROUP_SIZE",
    "INT4_GROUP_SIZES",
    "Bits",
    "Int4GroupSize",
    "QuantLinear",
    "check_quantizable",
    "quantize_rtn",
]

Bits = Literal[4, 8]
#: Group sizes torch's int4 kernels accept.
Int4GroupSize = Literal[32, 64, 128, 256]
BITS: tuple[int, ...] = get_args(Bits)
INT4_GROUP_SIZES: tuple[int, ...] = get_args(Int4GroupSize)
#: int4 group size when none is given.
DEFAULT_GROUP_SIZE = 128
# The CPU int4 packing wants a multiple of 16 output rows; CUDA's a multiple of 8. Rows are padded.
_INT4_ROW_MULTIPLE = 16
# torch 2.13's CPU int8 kernel reads past the row (wrong results or a segfault) unless K % 16 == 0.
_INT8_K_MULTIPLE = 16


def quantize_rtn(
    weight: torch.Tensor, bits: int, group_size: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groupwise round-to-nearest quantization.

    Each row of ``weight`` is cut into groups of ``group_size`` input features; a group gets one
    ``scale`` and one ``offset`` so that ``w ~= (q - mid) * scale + offset`` with integer codes
    ``q`` in ``0 .. 2**bits - 1`` and ``mid = 2**(bits - 1)``. Asymmetric: the group's
    [min, max] maps onto the full code range. Symmetric: ``offset = 0`` and ``scale = absmax / (mid - 1)``.

    Args:
        weight: ``[N, K]`` float weight; ``K % group_size == 0``.
        bits: 4 or 8.
        group_size: input features per group.
        symmetric: zero offset (symmetric) or min/max (asymmetric) ranges.

    Returns:
        ``(codes, scale, offset)``: codes ``[N, K]`` uint8 in ``0 .. 2**bits - 1``, scale and
        offset ``[N, K // group_size]`` float32.
    """
    n, k = weight.shape
    levels = (1 << bits) - 1
    mid = 1 << (bits - 1)
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    tiny = torch.finfo(torch.float32).tiny
    if symmetric:
        scale = (w.abs().amax(-1) / (mid - 1)).clamp_min(tiny)
        offset = torch.zeros_like(scale)
        q = torch.round(w / scale[..., None]) + mid
    else:
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / levels).clamp_min(tiny)
        # w = (q - mid) * scale + offset with q = 0 at the group minimum.
        offset = lo + mid * scale
        q = torch.round((w - lo[..., None]) / scale[..., None])
    codes = q.clamp_(0, levels).to(torch.uint8).reshape(n, k)
    return codes, scale, offset


def check_quantizable(name: str, in_features: int, bits: int, group_size: int | None) -> None:
    """Raise ValueError, naming the layer and the rule, when the kernels cannot take this layer."""
    if bits == 4:
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"group_size={group_size} is not supported by torch's int4 kernels (layer {name}): "
                f"use one of {INT4_GROUP_SIZES}"
            )
        if in_features % group_size:
            fits = [g for g in INT4_GROUP_SIZES if in_features % g == 0]
            if fits:
                hint = f"use group_size in {fits}"
            elif in_features % _INT8_K_MULTIPLE == 0:
                hint = "no int4 group size fits: use bits=8"
            else:
                hint = "no int4 group size fits and int8 needs a multiple of 16: this model cannot be drafted"
            raise ValueError(
                f"layer {name} has in_features={in_features}, not divisible by group_size={group_size} "
                f"(int4 groups must tile the input features): {hint}"
            )
    elif bits == 8:
        if in_features % _INT8_K_MULTIPLE:
            raise ValueError(
                f"layer {name} has in_features={in_features}; torch's int8 kernel needs a multiple of "
                f"{_INT8_K_MULTIPLE}: use bits=4 with a group size that divides it, or keep this model dense"
            )
    else:
        raise ValueError(f"bits={bits!r} is not supported: use one of {BITS}")


class QuantLinear(nn.Module):
    """Drop-in for ``nn.Linear`` (inference only) with int4-groupwise or int8-per-channel weights.

    Buffers are allocated once at construction; :meth:`load_` quantizes a new weight into them in
    place, so their storage never moves (a drafter refreshed after every optimizer step keeps its
    addresses, which CUDA graphs and engines that registered the buffers rely on).

    Args:
        in_features: K.
        out_features: N.
        bits: 4 (groupwise) or 8 (per output channel).
        group_size: int4 group size (ignored for int8, which is per-channel).
        symmetric: symmetric or asymmetric ranges.
        bias: whether the layer has a bias.
        compute_dtype: activation dtype of the kernel (bfloat16: the vectorised path).
        device: where the buffers live.
        out_dtype: dtype of the returned activations (the dtype the rest of the model runs in).
        kernel: "native" (torch's low-bit op), "dequant" (dequantize on every call) or None to
            probe the device and take "native" when the op exists.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int = 4,
        group_size: int = DEFAULT_GROUP_SIZE,
        symmetric: bool = False,
        bias: bool = False,
        compute_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        out_dtype: torch.dtype | None = None,
        kernel: str | None = None,
    ) -> None:
        super().__init__()
        check_quantizable("<QuantLinear>", in_features, bits, group_size if bits == 4 else None)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.symmetric = bits, symmetric
        self.group_size = group_size if bits == 4 else in_features
        self.compute_dtype = compute_dtype
        self.out_dtype = out_dtype or compute_dtype
        device = torch.device(device)
        if kernel not in (None, "native", "dequant"):
            raise ValueError(f"kernel={kernel!r}: use 'native', 'dequant' or None (probe the device)")
        self.kernel = kernel or _pick_kernel(bits, device, self.group_size)
        n, k = out_features, in_features
        if bits == 4:
            self.n_pad = -(-n // _INT4_ROW_MULTIPLE) * _INT4_ROW_MULTIPLE
            if self.kernel == "native":
                try:
                    packed = _pack_int4(torch.zeros(self.n_pad, k, dtype=torch.uint8, device=device), device)
                except RuntimeError as err:  # a shape this device's packing refuses
                    logger.warning(
                        "int4 packing refused [%d, %d] on %s (%s); dequantizing on the fly", n, k, device, err
                    )
                    self.kernel = "dequant"
            if self.kernel == "native":
                self.register_buffer("packed", torch.zeros_like(packed))
            else:
                self.register_buffer("codes", torch.zeros(self.n_pad, k, dtype=torch.uint8, device=device))
            groups = k // self.group_size
            # tinygemm layout: [K // group, N, 2] with (scale, zero) where w = (q - 8) * scale + zero.
            self.register_buffer(
                "scales_and_zeros", torch.zeros(groups, self.n_pad, 2, dtype=compute_dtype, device=device)
            )
        else:
            self.n_pad = n
            self.register_buffer("qweight", torch.zeros(n, k, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.zeros(n, dtype=compute_dtype, device=device))
            # Asymmetric int8: w = q * scale + offset (q signed); the offset term is x.sum(-1) * offset.
            if not symmetric:
                self.register_buffer("offsets", torch.zeros(n, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(n, dtype=compute_dtype, device=device))
        else:
            self.bias = None

    @torch.no_grad()
    def load_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Quantize ``weight`` ([N, K]) and ``bias`` ([N]) into this layer's existing buffers."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} does not fit a QuantLinear of "
                f"({self.out_features}, {self.in_features})"
            )
        if (bias is None) != (self.bias is None):
            raise ValueError("bias presence differs from the layer this drafter was built from")
        w = weight.detach().to(self.scales_and_zeros.device if self.bits == 4 else self.qweight.device)
        if self.bits == 4:
            if self.n_pad != self.out_features:
                w = torch.cat([w, w.new_zeros(self.n_pad - self.out_features, self.in_features)])
            codes, scale, offset = quantize_rtn(w, 4, self.group_size, self.symmetric)
            sz = torch.stack([scale, offset], -1).transpose(0, 1)  # [K // group, N, 2]
            self.scales_and_zeros.copy_(sz)
            if self.kernel == "native":
                self.packed.copy_(_pack_int4(codes, w.device))
            else:
                self.codes.copy_(codes)
        else:
            codes, scale, offset = quantize_rtn(w, 8, self.in_features, self.symmetric)
            self.qweight.copy_((codes.to(torch.int16) - 128).to(torch.int8))
            self.scales.copy_(scale[:, 0])
            if not self.symmetric:
                self.offsets.copy_(offset[:, 0])
        if bias is not None:
            self.bias.copy_(bias.detach())

    def dequantize(self) -> torch.Tensor:
        """The weight this layer computes with, ``[N, K]`` float32 (for tests and the fallback path)."""
        if self.bits == 4:
            sz = self.scales_and_zeros.float()
            codes = self.codes if self.kernel != "native" else self._unpacked_codes()
            q = codes.float().reshape(self.n_pad, -1, self.group_size) - 8
            w = q * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
            return w.reshape(self.n_pad, self.in_features)[: self.out_features]
        w = self.qweight.float() * self.scales.float()[:, None]
        if not self.symmetric:
            w = w + self.offsets[:, None]
        return w

    def _unpacked_codes(self) -> torch.Tensor:
        # The packed layout is opaque; recover the codes by multiplying with the identity (exact:
        # each output is (q - 8) * scale + zero with scale = 1, zero = 8 in float arithmetic).
        eye = torch.eye(self.in_features, dtype=self.compute_dtype, device=self.packed.device)
        ones = torch.zeros_like(self.scales_and_zeros)
        ones[..., 0] = 1
        ones[..., 1] = 8
        return _int4_mm(eye, self.packed, self.group_size, ones).t().round().to(torch.uint8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` for ``x`` of shape ``[..., K]``; returns ``[..., N]`` in ``out_dtype``."""
        shape = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()
        if self.kernel == "dequant":
            y = x2 @ self.dequantize().to(self.compute_dtype).t()
        elif self.bits == 4:
            y = _int4_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
            if self.n_pad != self.out_features:
                y = y[:, : self.out_features]
        else:
            y = compat.int8_mm(x2, self.qweight, self.scales)
            if not self.symmetric:
                y = y + (x2.float().sum(-1, keepdim=True) * self.offsets).to(y.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype).reshape(*shape, self.out_features)

    def extra_repr(self) -> str:
        g = f"group_size={self.group_size}" if self.bits == 4 else "per-channel"
        sym = "symmetric" if self.symmetric else "asymmetric"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits} {g} {sym}, "
            f"kernel={self.kernel}, compute={self.compute_dtype}"
        )


def _pack_int4(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pack ``[N, K]`` 4-bit codes into the layout of the device's int4 kernel."""
    return compat.int4_pack(codes, device)


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor) -> torch.Tensor:
    return compat.int4_mm(x, packed, group_size, sz)


_KERNEL_PROBES: dict[tuple[int, str, int], str] = {}


def _pick_kernel(bits: int, device: torch.device, group_size: int) -> str:
    """'native' when the device's low-bit op exists and computes correctly, else 'dequant'."""
    key = (bits, device.type, group_size if bits == 4 else 0)
    if key in _KERNEL_PROBES:
        return _KERNEL_PROBES[key]
    kernel = "native"
    try:
        # Probe a small layer of the same kind: all weights 1, so every output must equal K.
        k = max(group_size, 128) if bits == 4 else 128
        x = torch.ones(2, k, dtype=torch.bfloat16, device=device)
        if bits == 4:
            codes = torch.full((_INT4_ROW_MULTIPLE, k), 9, dtype=torch.uint8, device=device)
            sz = torch.zeros(k // group_size, _INT4_ROW_MULTIPLE, 2, dtype=torch.bfloat16, device=device)
            sz[..., 0] = 1  # (9 - 8) * 1 + 0
            y = _int4_mm(x, _pack_int4(codes, device), group_size, sz)
        else:
            q = torch.ones(16, k, dtype=torch.int8, device=device)
            y = compat.int8_mm(x, q, torch.ones(16, dtype=torch.bfloat16, device=device))
        if not bool((y.float() == k).all()):
            raise RuntimeError(f"int{bits} kernel probe returned {y.flatten()[:4].tolist()}, expected {k}")
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        logger.warning("int%d kernel unavailable on %s (%s); dequantizing on the fly", bits, device, err)
        kernel = "dequant"
    _KERNEL_PROBES[key] = kernel
    return kernel
