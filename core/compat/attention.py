"""transformers' attention and experts selection: the implementation a config names, forkrl's
attention registered beside transformers' own, and the gradient-checkpointing flag tree passes turn off."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn
from transformers import AttentionInterface, PretrainedConfig

from .registry import CHECKED, Private


def _check_attn_impl() -> None:
    cfg = PretrainedConfig()
    cfg._attn_implementation = "sdpa"
    assert cfg._attn_implementation == "sdpa"


def attention_implementation(config: PretrainedConfig) -> str | None:
    """The attention implementation a model config selects (``"sdpa"``, ``"eager"``, ...)."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config: PretrainedConfig, name: str) -> None:
    """Select attention implementation ``name`` (a registered :class:`AttentionInterface` key)."""
    config._attn_implementation = name


def _check_experts_impl() -> None:
    cfg = PretrainedConfig()
    cfg._experts_implementation = "eager"
    assert cfg._experts_implementation == "eager"


def set_experts_implementation(config: PretrainedConfig, name: str) -> None:
    """Select the MoE experts implementation (``"eager"``: a plain loop, any dtype)."""
    config._experts_implementation = name


def _check_attention_interface() -> None:
    assert callable(AttentionInterface.register)


def register_attention(name: str, fn: Callable) -> None:
    """Register an attention function with transformers under ``name``."""
    AttentionInterface.register(name, fn)


def _check_checkpointing_flag() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1
    )
    model = LlamaForCausalLM(cfg)
    set_checkpointing(model, True)
    assert any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def set_checkpointing(model: nn.Module, on: bool) -> None:
    """transformers' activation checkpointing on or off, by the name the installed version has:
    ``activation_checkpointing_enable``/``_disable`` where they exist (5.25 has them, 5.17 not),
    since the older ``gradient_checkpointing_*`` names then warn on every call and go in v6."""
    verb = "enable" if on else "disable"
    new = getattr(model, f"activation_checkpointing_{verb}", None)
    (new or getattr(model, f"gradient_checkpointing_{verb}"))()


@contextlib.contextmanager
def checkpointing_off(model: nn.Module) -> Iterator[bool]:
    """Turn transformers' gradient checkpointing off for the duration; yields whether it was on."""
    mods = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in mods:
        m.gradient_checkpointing = False
    try:
        yield bool(mods)
    finally:
        for m in mods:
            m.gradient_checkpointing = True


#: This area's entries (checked by ``tests/core/test_compat.py``).
PRIVATES: tuple[Private, ...] = (
    Private(
        "transformers",
        "PretrainedConfig._attn_implementation",
        "read to pick the attention path (sdpa/eager/flash) and written for the duration of a tree pass "
        "to route attention through forkrl's split attention; the speculative sampler reads it to build "
        "a mask the implementation accepts",
        _check_attn_impl,
        CHECKED,
    ),
    Private(
        "transformers",
        "PretrainedConfig._experts_implementation",
        "tiny MoE test models (Qwen3-Next) run their experts eagerly: grouped_mm has no float64 kernel",
        _check_experts_impl,
        CHECKED,
    ),
    Private(
        "transformers",
        "transformers.AttentionInterface.register",
        "registers forkrl's split attention under its own name, selected only inside tree passes",
        _check_attention_interface,
        CHECKED,
    ),
    Private(
        "transformers",
        "nn.Module.gradient_checkpointing",
        "transformers' checkpointed layers drop the cache (past_key_values=None); the executor turns the flag "
        "off on every module for the duration of a tree pass",
        _check_checkpointing_flag,
        CHECKED,
    ),
)
