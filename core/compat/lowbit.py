"""torch's weight-only int4/int8 matmul ops, which the drafter's low-bit linear layers run."""

from __future__ import annotations

import torch

from .registry import CHECKED, Private


def _check_low_bit_ops() -> None:
    for op in ("_weight_int4pack_mm", "_weight_int8pack_mm", "_convert_weight_to_int4pack"):
        assert hasattr(torch.ops.aten, op), op
    for op in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"):
        assert hasattr(torch.ops.aten, op), op


def int4_pack(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pack ``[N, K]`` uint8 4-bit codes into the layout of the device's int4 kernel."""
    if device.type == "cuda":
        pairs = (codes[:, ::2] << 4) | codes[:, 1::2]  # [N, K/2] uint8, high nibble first
        k = codes.shape[1]
        tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), tiles)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ dequant(packed).T`` with tinygemm ``scales_and_zeros`` ``[K // group, N, 2]``."""
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, sz)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, sz)


def int8_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (qweight * scales[:, None]).T`` for int8 ``[N, K]`` weights."""
    return torch.ops.aten._weight_int8pack_mm(x, qweight, scales)


#: This area's entries (checked by ``tests/core/test_compat.py``).
PRIVATES: tuple[Private, ...] = (
    Private(
        "torch",
        "torch.ops.aten._convert_weight_to_int4pack(_for_cpu), _weight_int4pack_mm(_for_cpu), _weight_int8pack_mm",
        "the drafter's low-bit linear layers run torch's own weight-only kernels (tinygemm int4 groupwise, "
        "int8 per channel); where a kernel is missing the layer dequantizes instead",
        _check_low_bit_ops,
        CHECKED,
    ),
)
