"""Multi-head latent attention modules (DeepSeek-V2/V3, Kimi K2, MiniCPM3): their latent cache
fields and ``expand_kv``, replaced for a split pass (:mod:`forkrl.core.attention.latent`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .registry import CHECKED, Private, parameter_names

# What an MLA attention module (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite, Mistral 4, ...) must have
# for forkrl's latent split attention: its sizes, the up-projection and the expansion method.
_MLA_FIELDS = ("kv_b_proj", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_heads")


def _check_mla() -> None:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=8, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, kv_lora_rank=4, q_lora_rank=None, qk_rope_head_dim=2, qk_nope_head_dim=2,
        v_head_dim=4, first_k_dense_replace=1,
    )  # fmt: skip
    (module,) = mla_modules(DeepseekV2ForCausalLM(cfg))
    assert parameter_names(module.expand_kv) == ["kv_nope", "k_rot"]
    k, v = module.expand_kv(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 2))
    assert k.shape == (1, 2, 3, 4) and v.shape == (1, 2, 3, 4)
    assert module.kv_b_proj.weight.shape == (2 * (2 + 4), 4)


def mla_modules(model: nn.Module) -> list[nn.Module]:
    """The multi-head latent attention modules of ``model`` (those with an ``expand_kv`` method
    and the MLA sizes)."""
    return [
        m
        for m in model.modules()
        if callable(getattr(type(m), "expand_kv", None)) and all(hasattr(m, f) for f in _MLA_FIELDS)
    ]


@contextlib.contextmanager
def expand_kv_replaced(modules: list[nn.Module], make: Callable[[nn.Module], Callable]) -> Iterator[None]:
    """For the duration, each module's ``expand_kv`` is ``make(module)`` (an instance attribute;
    the class's method is untouched and serves again afterwards)."""
    for m in modules:
        m.__dict__["expand_kv"] = make(m)
    try:
        yield
    finally:
        for m in modules:
            m.__dict__.pop("expand_kv", None)


def _check_module_hooks() -> None:
    layer = nn.Linear(2, 2)
    assert not layer._forward_pre_hooks and not layer._forward_hooks
    layer.register_forward_pre_hook(lambda *_: None)
    layer.register_forward_hook(lambda *_: None)
    assert len(layer._forward_pre_hooks) == 1 and len(layer._forward_hooks) == 1


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether anything hooks ``module``'s forward (LoRA, quantization or sharding wrappers that
    change what it computes: the latent attention then cannot absorb its weight into the queries)."""
    return bool(module._forward_pre_hooks or module._forward_hooks)


#: This area's entries (checked by ``tests/core/test_compat.py``).
PRIVATES: tuple[Private, ...] = (
    Private(
        "transformers",
        "<MLA attention>.expand_kv(kv_nope, k_rot) and kv_b_proj/kv_lora_rank/qk_nope_head_dim/qk_rope_head_dim/"
        "v_head_dim/num_heads",
        "MLA models cache the latent ([B, 1, n, kv_lora_rank] and the shared roped key [B, 1, n, rope]) and expand "
        "it into per-head keys/values after the cache returns it, so the ancestors' pieces attached to the cache's "
        "tensor never reach the attention function; for the duration of a split-attention pass each module's "
        "expand_kv is replaced (on the instance) by one that hands the latent itself to forkrl's attention",
        _check_mla,
        CHECKED,
    ),
    Private(
        "torch",
        "nn.Module._forward_pre_hooks / _forward_hooks",
        "the latent attention absorbs kv_b_proj's weight into the queries only where nothing hooks its forward "
        "(a hook may change what the projection computes); else the module's own expansion runs",
        _check_module_hooks,
        CHECKED,
    ),
)
