"""forkrl's round-to-nearest drafter quantization as a vLLM quantization method.

vLLM quantizes a draft model with ``speculative_config["quantization"]``; its own methods (fp8 and
the online shorthands of vLLM 0.29) are not forkrl's int4 groupwise / int8 per-channel
round-to-nearest. These classes register forkrl's under the names of :data:`QUANT_METHODS`
(``forkrl_int4_g32`` ... ``forkrl_int4_g256``, ``forkrl_int8``), so vLLM's drafter holds exactly
the codes and scales :class:`~forkrl.core.quant.QuantLinear` computes from the same weight and runs
torch's same low-bit kernels: a drafter in vLLM equals forkrl's Hugging Face drafter row for row.

Every vLLM ``LinearBase`` layer (fused QKV, gate/up, output, down projections) loads its dense
weight as usual; ``process_weights_after_loading`` quantizes it into a :class:`QuantLinear` whose
buffers are also registered on the vLLM layer (``forkrl_*``), so vLLM's memory accounting and its
layerwise reload (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``) see them, and a
reload re-quantizes into the same storage (CUDA graphs stay valid). Embeddings, norms and the LM
head stay dense. A layer whose input partition no group size tiles stays dense too (logged once).

This module imports vLLM at the top: :func:`forkrl.plugins.vllm.register` imports it inside vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from forkrl.core.quant import QuantLinear, check_quantizable
from forkrl.plugins.vllm.speculative import QUANT_METHODS

logger = logging.getLogger(__name__)

__all__ = ["ForkrlRTNConfig", "ForkrlRTNLinearMethod", "register_all"]

# Where the layer keeps its QuantLinear: an instance attribute, not a submodule, so vLLM's
# module walks (reload bookkeeping, memory reports) see the tensors once, on the layer itself.
_HOLDER = "_forkrl_quant"


class ForkrlRTNConfig(QuantizationConfig):
    """Round-to-nearest weight-only quantization of every linear layer (one subclass per name)."""

    name: str = ""
    bits: int = 4
    group_size: int | None = 128

    def get_name(self) -> str:  # noqa: D102
        return self.name

    def get_supported_act_dtypes(self) -> list[torch.dtype]:  # noqa: D102
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:  # noqa: D102
        return 80  # torch's int4 tinygemm kernel is built for sm80+

    @staticmethod
    def get_config_filenames() -> list[str]:  # noqa: D102
        return []  # nothing read from the checkpoint: vLLM then builds the config with no arguments

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ForkrlRTNConfig:  # noqa: D102
        return cls()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:  # noqa: D102
        if isinstance(layer, LinearBase):
            return ForkrlRTNLinearMethod(self.bits, self.group_size, prefix)
        return None  # embeddings, the LM head, experts: vLLM's unquantized methods


class ForkrlRTNLinearMethod(LinearMethodBase):
    """Dense load, forkrl RTN quantization after loading, torch's int4/int8 kernel in ``apply``."""

    def __init__(self, bits: int, group_size: int | None, prefix: str) -> None:
        self.bits, self.group_size, self.prefix = bits, group_size, prefix

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        """The dense ``[sum(output_partition_sizes), input_size_per_partition]`` weight vLLM loads."""
        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            input_dim=1,
            output_dim=0,
            weight_loader=weight_loader,
        )
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        try:
            check_quantizable(self.prefix, input_size_per_partition, self.bits, self.group_size)
            layer.forkrl_dense = False
        except ValueError as err:
            logger.warning("forkrl drafter: %s; this layer stays dense", err)
            layer.forkrl_dense = True

    @torch.no_grad()
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Quantize the loaded weight into the layer's QuantLinear (in place when it exists)."""
        if layer.forkrl_dense:
            return
        weight = layer.weight.data
        q: QuantLinear | None = layer.__dict__.get(_HOLDER)
        if q is None:
            n, k = weight.shape
            q = QuantLinear(
                k,
                n,
                bits=self.bits,
                group_size=self.group_size or k,
                compute_dtype=torch.bfloat16,
                device=weight.device,
                out_dtype=weight.dtype,
            )
            layer.__dict__[_HOLDER] = q
        q.load_(weight)
        del layer.weight
        for name, buf in q.named_buffers():
            layer.register_buffer(f"forkrl_{name}", buf)

    @torch.no_grad()
    def requantize(self, layer: torch.nn.Module, weight: torch.Tensor) -> None:
        """Quantize a new dense ``weight`` ([N, K], the target layer's) into this layer's buffers."""
        if layer.forkrl_dense:
            layer.weight.copy_(weight)
        else:
            layer.__dict__[_HOLDER].load_(weight)

    def dense_shape(self, layer: torch.nn.Module) -> tuple[int, int]:
        """``(N, K)`` of the dense weight the layer was loaded with (what :meth:`requantize` takes)."""
        if layer.forkrl_dense:
            return tuple(layer.weight.shape)
        q = layer.__dict__[_HOLDER]
        return (q.out_features, q.in_features)

    def dequantized(self, layer: torch.nn.Module) -> torch.Tensor:
        """The weight the layer computes with, ``[N, K]`` (for tests)."""
        if layer.forkrl_dense:
            return layer.weight.detach()
        return layer.__dict__[_HOLDER].dequantize()

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for ``x`` of shape ``[..., K]``."""
        if layer.forkrl_dense:
            return F.linear(x, layer.weight, bias)
        y = layer.__dict__[_HOLDER](x).to(x.dtype)
        return y if bias is None else y + bias


def register_all() -> None:
    """Register one vLLM quantization config per name in :data:`QUANT_METHODS` (idempotent)."""
    for name, (bits, group) in QUANT_METHODS.items():
        cls = type(
            f"ForkrlRTN_{name}",
            (ForkrlRTNConfig,),
            {"name": name, "bits": bits, "group_size": group, "__module__": __name__},
        )
        register_quantization_config(name)(cls)
