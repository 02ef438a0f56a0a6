"""Weight-only low-bit linear layers on torch's own kernels, and the self-drafter built from them.

- :mod:`.linear`: round-to-nearest quantization and :class:`QuantLinear` (int4 groupwise, int8
  per channel), with the bit widths and group sizes the kernels accept.
- :mod:`.drafter`: :class:`Drafter`, the policy's quantized copy, refreshed in place.
"""

from .drafter import Drafter, model_signature, unwrap
from .linear import (
    BITS,
    DEFAULT_GROUP_SIZE,
    INT4_GROUP_SIZES,
    Bits,
    Int4GroupSize,
    QuantLinear,
    check_quantizable,
    quantize_rtn,
)

__all__ = [
    "BITS",
    "DEFAULT_GROUP_SIZE",
    "INT4_GROUP_SIZES",
    "Bits",
    "Drafter",
    "Int4GroupSize",
    "QuantLinear",
    "check_quantizable",
    "model_signature",
    "quantize_rtn",
    "unwrap",
]
