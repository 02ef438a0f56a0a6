"""The self-drafter: a weight-quantized copy of the policy, re-derived in place after every update."""

from __future__ import annotations

import copy
from collections import Counter

import torch
from torch import nn

from .linear import BITS, DEFAULT_GROUP_SIZE, QuantLinear, check_quantizable

__all__ = ["Drafter", "model_signature", "unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside DDP / DeepSpeed-style wrappers (they keep it as ``.module``)."""
    while isinstance(getattr(model, "module", None), nn.Module) and not hasattr(model, "config"):
        model = model.module
    return model


def model_signature(model: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter: what a drafter and the policy it mirrors must share."""
    return tuple((n, tuple(p.shape)) for n, p in unwrap(model).named_parameters())


class Drafter:
    """A weight-quantized copy of a policy model: the draft model of self-speculative sampling.

    Every ``nn.Linear`` (attention and MLP projections, and the LM head unless
    ``quantize_lm_head=False``) becomes a :class:`QuantLinear` running torch's int4/int8 kernel.
    Embeddings and norms are copied densely in ``compute_dtype``: an embedding lookup reads one row
    per token, so quantizing it would save memory but no time, and norms are tiny. The LM head is
    quantized by default because in small and mid-sized models it is the largest single matmul
    (vocab x hidden); with tied embeddings the drafter unties them (a dense embedding copy plus a
    quantized head, both re-derived from the one shared policy weight on every refresh).

    The drafter shares nothing mutable with the policy: the module structure is a deep copy whose
    parameters are fresh tensors. :meth:`refresh` re-quantizes the current policy weights into the
    same buffers (no allocation that outlives the call, addresses unchanged).

    Use :meth:`from_policy` to build one.
    """

    def __init__(
        self,
        model: nn.Module,
        quantized: dict[str, QuantLinear],
        dense: dict[str, nn.Parameter],
        signature: tuple,
        bits: int,
        group_size: int | None,
        symmetric: bool,
        compute_dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.quantized = quantized
        self.dense = dense
        self.signature = signature
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.compute_dtype = compute_dtype

    @staticmethod
    def check(
        model: nn.Module, bits: int = 4, group_size: int | None = None, quantize_lm_head: bool = True
    ) -> dict[str, nn.Linear]:
        """Raise ValueError now, naming the layer and the sizes that fit, when :meth:`from_policy`
        could not draft ``model`` with these settings (arguments as there); returns the linear
        layers it would quantize, by name. Reads shapes only: nothing is quantized or copied."""
        if isinstance(bits, bool) or bits not in BITS:
            raise ValueError(f"bits={bits!r} is not supported: use one of {BITS}")
        if bits == 8 and group_size is not None:
            raise ValueError(
                f"group_size={group_size} with bits=8: torch's int8 kernel takes one scale per output "
                "channel, so int8 is per-channel; pass group_size=None (or use bits=4 for groups)"
            )
        group = (group_size or DEFAULT_GROUP_SIZE) if bits == 4 else None
        policy = unwrap(model)
        for name, module in policy.named_modules():
            if hasattr(module, "base_layer") or type(module).__module__.startswith("peft"):
                raise ValueError(
                    f"{name or type(module).__name__} is a PEFT adapter layer; the drafter needs the merged "
                    "weights: build it from a merged copy (model.merge_and_unload()) or from the base model"
                )
        head = policy.get_output_embeddings() if hasattr(policy, "get_output_embeddings") else None
        linears = {
            name: m
            for name, m in policy.named_modules()
            if isinstance(m, nn.Linear) and (quantize_lm_head or m is not head)
        }
        for name, m in linears.items():
            check_quantizable(name, m.in_features, bits, group)
        return linears

    @classmethod
    @torch.no_grad()
    def from_policy(
        cls,
        model: nn.Module,
        bits: int = 4,
        group_size: int | None = None,
        symmetric: bool = False,
        compute_dtype: torch.dtype = torch.bfloat16,
        quantize_lm_head: bool = True,
        kernel: str | None = None,
    ) -> Drafter:
        """Build a quantized drafter from a policy model.

        Args:
            model: a Hugging Face causal LM (or a DDP/DeepSpeed wrapper holding one as ``.module``).
            bits: 4 (groupwise, default) or 8 (one scale per output channel: torch's int8 kernel
                takes exactly one scale per row).
            group_size: int4 group size, one of 32, 64, 128, 256 (default 128). Must divide the
                in_features of every quantized layer; a layer that it does not divide is refused with
                a ValueError naming the layer and the sizes that would fit (the drafter never picks a
                different group silently). Must be None for int8.
            symmetric: symmetric (zero offset) instead of asymmetric (min/max) ranges.
            compute_dtype: activation dtype of the drafter (bfloat16: the vectorised kernel path).
            quantize_lm_head: quantize the LM head too (default) or keep it dense in compute_dtype.
            kernel: force "native" or "dequant" for every layer (None: probe the device).

        Returns:
            The drafter, on the policy's device, in eval mode, with no parameter requiring grad.
        """
        linears = cls.check(model, bits, group_size, quantize_lm_head)
        group = (group_size or DEFAULT_GROUP_SIZE) if bits == 4 else None
        policy = unwrap(model)
        params = list(policy.parameters())
        if not params:
            raise ValueError("the policy has no parameters to quantize")
        device = params[0].device

        # Deep-copy the structure with every parameter replaced by a meta placeholder (tied
        # parameters share one placeholder), so no dense copy of the weights is ever made.
        memo = {
            id(p): nn.Parameter(torch.empty(p.shape, dtype=compute_dtype, device="meta"), requires_grad=False)
            for p in params
        }
        clone = copy.deepcopy(policy, memo)
        quantized: dict[str, QuantLinear] = {}
        for name, m in linears.items():
            q = QuantLinear(
                m.in_features,
                m.out_features,
                bits=bits,
                group_size=group or m.in_features,
                symmetric=symmetric,
                bias=m.bias is not None,
                compute_dtype=compute_dtype,
                device=device,
                kernel=kernel,
            )
            q.load_(m.weight, m.bias)
            parent, _, leaf = name.rpartition(".")
            setattr(clone.get_submodule(parent), leaf, q)
            quantized[name] = q
        dense: dict[str, nn.Parameter] = {}
        made: dict[int, nn.Parameter] = {}
        for name, placeholder in list(clone.named_parameters(remove_duplicate=False)):
            if id(placeholder) not in made:
                src = policy.get_parameter(name)
                made[id(placeholder)] = nn.Parameter(
                    src.detach().to(device=device, dtype=compute_dtype, copy=True), requires_grad=False
                )
                dense[name] = made[id(placeholder)]
            parent, _, leaf = name.rpartition(".")
            setattr(clone.get_submodule(parent), leaf, made[id(placeholder)])
        clone.to(device)
        clone.eval()
        return cls(clone, quantized, dense, model_signature(policy), bits, group, symmetric, compute_dtype)

    @torch.no_grad()
    def refresh(self, model: nn.Module) -> Drafter:
        """Re-derive the drafter from the policy's current weights, in place (call after each optimizer step).

        Quantizes every layer into its existing buffers and copies the dense parameters into
        theirs; no drafter tensor is reallocated. Temporary float tensors of one layer's size
        are used while a layer is quantized.
        """
        policy = unwrap(model)
        if model_signature(policy) != self.signature:
            raise ValueError(
                "refresh() got a model whose parameter names/shapes differ from the policy this drafter "
                "was built from: build a new drafter with Drafter.from_policy(model)"
            )
        modules = dict(policy.named_modules())
        for name, q in self.quantized.items():
            m = modules[name]
            q.load_(m.weight, m.bias)
        for name, p in self.dense.items():
            p.copy_(policy.get_parameter(name))
        return self

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` has the parameter names and shapes of the policy this drafter mirrors."""
        return model_signature(model) == self.signature

    @property
    def config(self):  # noqa: ANN201 - a transformers PreTrainedConfig
        """The drafter's (copied) model config."""
        return self.model.config

    @property
    def kernels(self) -> dict[str, int]:
        """How many quantized layers run each kernel path ("native" or "dequant")."""
        return dict(Counter(q.kernel for q in self.quantized.values()))

    @property
    def kernel(self) -> str:
        """One-word summary: e.g. "int4-native", or "int4-dequant" when any layer dequantizes."""
        return f"int{self.bits}-" + ("dequant" if "dequant" in self.kernels else "native")

    def __call__(self, *args, **kwargs):  # noqa: D102
        return self.model(*args, **kwargs)

    def memory_bytes(self) -> int:
        """Bytes held by the drafter's parameters and buffers (each storage counted once)."""
        return _tensor_bytes(list(self.model.parameters()) + list(self.model.buffers()))

    def memory_report(self, policy: nn.Module | None = None) -> dict[str, float]:
        """Memory overhead of the drafter, split into quantized layers and dense copies.

        Args:
            policy: the policy model, to report the drafter's size relative to it.

        Returns:
            ``drafter_bytes``, ``quantized_bytes`` (codes + scales + biases of the QuantLinear
            layers), ``dense_bytes`` (embeddings, norms and other copied tensors), and, with a policy,
            ``policy_bytes`` and ``overhead_fraction`` (drafter / policy).
        """
        qbytes = _tensor_bytes([b for q in self.quantized.values() for b in q.buffers()])
        total = self.memory_bytes()
        out = {"drafter_bytes": total, "quantized_bytes": qbytes, "dense_bytes": total - qbytes}
        if policy is not None:
            pol = unwrap(policy)
            out["policy_bytes"] = _tensor_bytes(list(pol.parameters()) + list(pol.buffers()))
            out["overhead_fraction"] = total / max(out["policy_bytes"], 1)
        return out


def _tensor_bytes(tensors: list[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
