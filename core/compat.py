"""Every private of transformers and torch that ``forkrl.core`` relies on, in one place.

Each :class:`Private` names an attribute, op or field the rest of core uses, the versions it was
checked against, and why forkrl needs it; the accessors below are the only code in core that
touches them (the cache-layer subclasses in :mod:`forkrl.core.executor.cache` and the sampler's
ragged cache override the public layer methods and reach the internal fields through here).
``tests/core/test_compat.py`` runs every entry's check, so an upgrade that moves one fails in
one place with the entry's name and reason.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

try:  # transformers >= 5.2x: the cache layer of layers that keep nothing (MLP-only layers)
    from transformers.cache_utils import DummyLayer
except ImportError:  # older (the veRL and OpenRLHF pins): no model builds one

    class DummyLayer:  # type: ignore[no-redef]
        """Stand-in: no cache layer of this type exists in this transformers."""


__all__ = [
    "CHECKED",
    "PRIVATES",
    "Private",
    "check_private",
    "function_source",
    "parameter_names",
    "Cache",
    "DynamicCache",
    "DynamicLayer",
    "DummyLayer",
    "DynamicSlidingWindowLayer",
    "LinearAttentionAndFullAttentionLayer",
    "LinearAttentionLayer",
    "Private",
    "attention_implementation",
    "checkpointing_off",
    "fsdp2_param_dtype",
    "fsdp2_plain_class",
    "full_tensor",
    "conv_past",
    "dtensor_mesh",
    "flash_cpu",
    "flash_cpu_backward",
    "flash_cuda",
    "flash_cuda_backward",
    "has_flash_cuda",
    "init_cache",
    "int4_mm",
    "int4_pack",
    "int8_mm",
    "is_dtensor",
    "is_fsdp2_module",
    "mark_initialized",
    "next_recurrent_state",
    "out_of_place_ssm_step",
    "ssm_step_modules",
    "record_past",
    "scan_mixers",
    "scan_replaced",
    "mixer_layer",
    "take_recurrent_state",
    "reduce_scatter_like",
    "register_attention",
    "replace_layers",
    "seed_layer",
    "seed_sliding_layer",
    "seed_state_layer",
    "set_attention_implementation",
    "set_experts_implementation",
    "set_tensor",
    "store_conv_state",
    "store_recurrent_state",
    "engine_hooks_of",
    "expand_kv_replaced",
    "mla_modules",
    "is_zero3_param",
    "whole_shape",
]

#: The versions every entry below was read from and tested against.
CHECKED = "torch 2.13.0, transformers 5.25.0"


@dataclass(frozen=True)
class Private:
    """One private forkrl relies on.

    Attributes:
        name: dotted name of the attribute, op or field.
        why: what forkrl does with it, and what breaks without it.
        check: raises (AttributeError, AssertionError, ...) when the private is gone or changed.
    """

    name: str
    why: str
    check: Callable[[], None]


PRIVATES: list[Private] = []


def _private(name: str, why: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(check: Callable[[], None]) -> Callable[[], None]:
        PRIVATES.append(Private(name, why, check))
        return check

    return register


def parameter_names(fn: Callable) -> list[str]:
    """The names of ``fn``'s parameters, in order (what a private's check compares).

    A module-level function that transformers wrapped into a module (5.25's hub-kernel fallback
    wrapper for the Mamba kernels: an ``nn.Module`` instance whose ``forward`` is the function) is read
    through its ``forward``: the arguments the callers pass are the same.
    """
    import inspect

    if isinstance(fn, nn.Module):
        return [n for n in inspect.signature(type(fn).forward).parameters][1:]  # without self
    return list(inspect.signature(fn).parameters)


def function_source(module, name: str) -> str:
    """The source of module-level function ``name`` of ``module`` (from ``def``, without decorators),
    read from the module's own source: from 5.25 transformers (with the ``kernels`` package it
    depends on) replaces some of them by a module instance (``kernels``' ``use_kernel_forward_from_hub``
    on a function), whose class ``inspect`` cannot locate."""
    import ast

    text = inspect.getsource(module)
    node = next(
        n
        for n in ast.parse(text).body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
    )
    return ast.get_source_segment(text, node)


def check_private(private: Private, library: str, checked: str) -> None:
    """Run ``private.check()``; any failure becomes an AssertionError naming the entry, what
    relies on it and the version it was read from (``library`` changed: ...)."""
    try:
        private.check()
    except Exception as err:  # noqa: BLE001 - any breakage names the entry
        raise AssertionError(
            f"{library} changed: {private.name} ({private.why}), checked against {checked}: {err!r}"
        ) from err


# ---------------------------------------------------------------------------- attention selection


@_private(
    "PretrainedConfig._attn_implementation",
    "read to pick the attention path (sdpa/eager/flash) and written for the duration of a tree pass "
    "to route attention through forkrl's split attention; the speculative sampler reads it to build "
    "a mask the implementation accepts",
)
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


@_private(
    "PretrainedConfig._experts_implementation",
    "tiny MoE test models (Qwen3-Next) run their experts eagerly: grouped_mm has no float64 kernel",
)
def _check_experts_impl() -> None:
    cfg = PretrainedConfig()
    cfg._experts_implementation = "eager"
    assert cfg._experts_implementation == "eager"


def set_experts_implementation(config: PretrainedConfig, name: str) -> None:
    """Select the MoE experts implementation (``"eager"``: a plain loop, any dtype)."""
    config._experts_implementation = name


@_private(
    "transformers.AttentionInterface.register",
    "registers forkrl's split attention under its own name, selected only inside tree passes",
)
def _check_attention_interface() -> None:
    assert callable(AttentionInterface.register)


def register_attention(name: str, fn: Callable) -> None:
    """Register an attention function with transformers under ``name``."""
    AttentionInterface.register(name, fn)


@_private(
    "nn.Module.gradient_checkpointing",
    "transformers' checkpointed layers drop the cache (past_key_values=None); the executor turns the flag "
    "off on every module for the duration of a tree pass",
)
def _check_checkpointing_flag() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1
    )
    model = LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable()
    assert any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


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


# ---------------------------------------------------------------------------- caches


@_private(
    "DynamicCache(config=...).layers",
    "the executor builds a fresh cache per tree node and replaces its layers with forkrl's recording "
    "layers seeded from the ancestors' tensors; the layer types tell attention, sliding and state layers apart",
)
def _check_cache_layers() -> None:
    from transformers import LlamaConfig

    cache = DynamicCache(config=LlamaConfig(num_hidden_layers=2))
    assert len(cache.layers) == 2 and type(cache.layers[0]) is DynamicLayer
    cache.layers = list(cache.layers)
    assert "layers" in parameter_names(Cache.__init__)


def replace_layers(cache: DynamicCache, layers: list) -> None:
    """Make ``cache`` run ``layers`` (forkrl's own layer objects) instead of the ones it built."""
    cache.layers = layers


def init_cache(cache: Cache, layers: list) -> None:
    """Initialise a ``Cache`` subclass instance with ``layers`` (skipping ``DynamicCache.__init__``,
    which would build layers from a config)."""
    Cache.__init__(cache, layers=layers)


@_private(
    "DynamicLayer.lazy_initialization/is_initialized/keys/values",
    "a node's cache layer is seeded with its ancestors' keys/values (leaf tensors) without copying; "
    "the sampler's fixed-capacity layer allocates its own buffers",
)
def _check_dynamic_layer() -> None:
    layer = DynamicLayer()
    assert parameter_names(DynamicLayer.lazy_initialization) == ["self", "key_states", "value_states"]
    assert not layer.is_initialized
    k = torch.zeros(1, 1, 2, 4)
    seed_layer(layer, k, k)
    assert layer.is_initialized and layer.keys is k and layer.get_seq_length() == 2
    assert parameter_names(DynamicLayer.get_mask_sizes) == ["self", "query_length"]
    assert callable(DynamicLayer.batch_select_indices)


def seed_layer(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``layer`` hold ``keys``/``values`` (``[B, kv_heads, n, head_dim]``) as its past, by reference."""
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values


def mark_initialized(layer: DynamicLayer, device: torch.device) -> None:
    """Mark a layer whose ``keys``/``values`` buffers its subclass allocated itself."""
    layer.device = device
    layer.is_initialized = True


@_private(
    "DynamicSlidingWindowLayer.sliding_window/cumulative_length",
    "a sliding-window node is seeded with only the last window - 1 ancestor positions, and the layer must "
    "still count every position before it for its mask",
)
def _check_sliding_layer() -> None:
    layer = DynamicSlidingWindowLayer(sliding_window=4)
    assert layer.sliding_window == 4
    k = torch.zeros(1, 1, 3, 4)
    seed_sliding_layer(layer, k, k, past_len=10)
    assert layer.get_seq_length() == 10


def seed_sliding_layer(
    layer: DynamicSlidingWindowLayer, keys: torch.Tensor, values: torch.Tensor, past_len: int
) -> None:
    """Seed a sliding-window layer with the window's tail of a ``past_len``-position context."""
    seed_layer(layer, keys, values)
    layer.cumulative_length = past_len


_STATE_FIELDS = (
    "record_past",
    "conv_states",
    "recurrent_states",
    "is_conv_states_initialized",
    "is_recurrent_states_initialized",
    "has_previous_state",
    "device",
    "dtype",
)


@_private(
    "LinearAttentionLayer fields (conv_states, recurrent_states, has_previous_state, record_past, ...) and "
    "update_conv_state/update_recurrent_state",
    "hybrid conv/recurrent layers (LFM2, Qwen3-Next) keep state in these; forkrl seeds a node's state from "
    "its parent's leaf tensors and overrides the updates to be out of place (transformers copies in place, "
    "which breaks autograd through a restored state); record_past makes the model take its multi-token path",
)
def _check_state_layer() -> None:
    layer = LinearAttentionLayer(number_of_states=1)
    for name in _STATE_FIELDS:
        assert hasattr(layer, name), name
    assert parameter_names(LinearAttentionLayer.update_conv_state)[:4] == [
        "self",
        "conv_states",
        "state_idx",
        "conv_kernel_size",
    ]
    assert parameter_names(LinearAttentionLayer.update_recurrent_state)[:3] == [
        "self",
        "recurrent_states",
        "state_idx",
    ]


def seed_state_layer(
    layer: LinearAttentionLayer, conv: torch.Tensor, recurrent: torch.Tensor | None, past_len: int
) -> None:
    """Give a conv/recurrent layer its parent's final states (``[B, C, kernel]``, recurrent or None)
    after ``past_len`` positions (from 5.25 the layer counts them for ``get_seq_length``)."""
    layer.device, layer.dtype = conv.device, conv.dtype
    if hasattr(layer, "cumulative_length_linear"):
        layer.cumulative_length_linear = torch.tensor(past_len, device=conv.device)
    layer.conv_states[0] = conv
    layer.is_conv_states_initialized[0] = True
    layer.has_previous_state[0] = True
    if recurrent is not None:
        layer.recurrent_states[0] = recurrent
        layer.is_recurrent_states_initialized[0] = True


def conv_past(layer: LinearAttentionLayer) -> torch.Tensor | None:
    """The conv inputs the layer holds from earlier tokens, or None at the start of a path."""
    return layer.conv_states[0] if layer.has_previous_state[0] else None


def store_conv_state(layer: LinearAttentionLayer, full: torch.Tensor) -> None:
    """Replace (out of place) the layer's conv state with ``full`` ``[B, C, n]``."""
    if layer.device is None:
        layer.device, layer.dtype = full.device, full.dtype
    layer.conv_states[0] = full
    layer.is_conv_states_initialized[0] = True
    layer.has_previous_state[0] = True


def store_recurrent_state(layer: LinearAttentionLayer, state: torch.Tensor) -> None:
    """Replace (out of place) the layer's recurrent state."""
    layer.recurrent_states[0] = state
    layer.is_recurrent_states_initialized[0] = True


def record_past(layer: LinearAttentionLayer) -> None:
    """Make the model take its out-of-place multi-token path for every length."""
    layer.record_past = True


# Mamba-2 mixers whose one-token step writes the recurrent state in place (record_past covers
# their conv; the SSM step ignores it). Up to transformers 5.24 the mixer steps the cache's own
# state; from 5.25 its module-level ``mamba2_scan_forward`` steps a copy (``recurrent_state.clone()``)
# and stores that copy through ``update_recurrent_state``, so the copy must end up holding the new state.
_SSM_MODULES = ("bamba", "falcon_h1", "granitemoehybrid", "mamba2", "nemotron_h", "zamba2")
_SSM_STEP = "mamba2_selective_state_update"
_SSM_ARGS = ["state", "hidden_states", "dt", "A", "B", "C", "D", "dt_bias", "dt_softplus", "z", "kwargs"]
_SSM_SCAN_FORWARD = "mamba2_scan_forward"  # 5.25: the mixers' scan, read from and stored to the cache


def _steps_a_copy(module) -> bool:
    """Whether the module's mixers step a copy of the cache's state and store the copy (5.25 on)."""
    return hasattr(module, _SSM_SCAN_FORWARD)


@_private(
    "transformers.models.{bamba,falcon_h1,granitemoehybrid,mamba2,nemotron_h,zamba2}.mamba2_selective_state_update "
    "(and, from 5.25, mamba2_scan_forward)",
    "the Mamba-2 one-token SSM step (a module global the mixers call) writes the recurrent state in place "
    "(state.copy_ after reading it), which autograd cannot take through a state restored from a tree node: tree "
    "passes swap in a step with the same arguments that reads the state out of place; up to 5.24 the mixer steps "
    "the cache's state and the new one rides on it, from 5.25 mamba2_scan_forward steps a clone and stores that "
    "clone, which the swapped step then overwrites with the new state",
)
def _check_ssm_step() -> None:
    import importlib
    import re

    for name in _SSM_MODULES:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        assert parameter_names(getattr(module, _SSM_STEP)) == _SSM_ARGS, name
        if _steps_a_copy(module):
            assert re.search(rf"{_SSM_SCAN_FORWARD}\(\s*self,", inspect.getsource(module)), name
            src = function_source(module, _SSM_SCAN_FORWARD)
            assert "next_state = recurrent_state.clone()" in src, name
            assert re.search(rf"{_SSM_STEP}\(\s*next_state,", src), name
            assert "cache.update_recurrent_state(next_state, module.layer_idx)" in src, name
        else:
            assert re.search(rf"{_SSM_STEP}\(\s*recurrent_state,", inspect.getsource(module)), name


def _ssm_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None):
    """One Mamba-2 SSM step, out of place: ``h' = exp(dt A) h + dt B x``, ``y = C h' + D x`` (gated
    by ``silu(z)``), shapes as transformers' step (``state [b, heads, head_dim, n]``, ``x, dt
    [b, heads, head_dim]``, ``B, C [b, groups, n]``). Returns ``(y, h')``, ``h'`` in ``state``'s dtype."""
    batch, heads, head_dim = hidden_states.shape
    groups, n = B.shape[1], B.shape[-1]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = dt[..., None]
    decay = torch.exp(dt.float() * A.float()).to(device=state.device)

    def per_head(t):  # [b, groups, n] -> [b, heads, n]
        return t[:, :, None, :].expand(batch, groups, heads // groups, n).reshape(batch, heads, n)

    inflow = (dt * per_head(B)[:, :, None, :] * hidden_states[..., None]).to(device=state.device)
    ssm = state * decay + inflow
    new_state = ssm.to(state.dtype)
    ssm = ssm.to(device=C.device, dtype=C.dtype)
    out = (ssm * per_head(C)[:, :, None, :]).sum(-1)
    if D is not None:
        out = (out + hidden_states * D).to(out.dtype)
    if z is not None:
        out = out * torch.nn.functional.silu(z)
    return out.to(hidden_states.dtype), new_state


def _ssm_step(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs):
    """:func:`_ssm_update` where the mixer steps the cache's own state (up to 5.24): that state is
    left as it was (a view of the parent's leaf tensor) and the next one rides on ``state.forkrl_next``."""
    out, state.forkrl_next = _ssm_update(state, hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z)
    return out


def _ssm_step_on_copy(
    state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs
):
    """:func:`_ssm_update` where the mixer steps a copy it then stores (5.25 on): the copy, which only
    ``clone`` produced and nothing saved, takes the new state in place; the update reads a second
    copy, so no tensor autograd saved is overwritten."""
    out, new_state = _ssm_update(state.clone(), hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z)
    state.copy_(new_state)
    return out


def ssm_step_modules(model: nn.Module) -> list:
    """The transformers modeling modules of ``model``'s Mamba-2 mixers (for :func:`out_of_place_ssm_step`)."""
    import sys

    modules = {sys.modules.get(type(m).__module__) for m in model.modules()}
    return [m for m in modules if m is not None and m.__name__.rsplit(".", 1)[-1].removeprefix("modeling_")
            in _SSM_MODULES and hasattr(m, _SSM_STEP)]  # fmt: skip


@contextlib.contextmanager
def out_of_place_ssm_step(modules: list) -> Iterator[None]:
    """For the duration, the Mamba-2 mixers of ``modules`` (:func:`ssm_step_modules`) take
    :func:`_ssm_step` (or :func:`_ssm_step_on_copy`) for one-token steps."""
    saved = [(m, getattr(m, _SSM_STEP)) for m in modules]
    for m, _ in saved:
        setattr(m, _SSM_STEP, _ssm_step_on_copy if _steps_a_copy(m) else _ssm_step)
    try:
        yield
    finally:
        for m, fn in saved:
            setattr(m, _SSM_STEP, fn)


# Mamba-1 mixers (selective scan, one SSM state per channel; Zamba's split into heads). Their torch
# path starts every multi-token input from a zero state (a module global the mixers call) and steps
# single tokens in place; a tree pass hides the parent's state from the mixer and hands it to
# forkrl's scan instead (:mod:`forkrl.core.executor.scan`). From 5.25 Mamba, FalconMamba and Jamba
# read and store the state in a module-level ``mamba_scan_forward(mixer, ...)`` (Zamba still inline).
_SCAN_MODULES = ("mamba", "falcon_mamba", "jamba", "zamba")
_SCAN = "mamba_selective_scan"
_SCAN_ARGS = ["hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "return_last_state"]  # fmt: skip
_SCAN_MIXER_ARGS = ["self", "hidden_states", "cache", "attention_mask", "kwargs"]
_SCAN_FORWARD = "mamba_scan_forward"


@_private(
    "transformers.models.{mamba,falcon_mamba,jamba,zamba}.mamba_selective_scan and *MambaMixer.forward "
    "(from 5.25, mamba_scan_forward and Cache.get_recurrent_states_to_keep)",
    "Mamba-1 mixers scan multi-token input from a zero state (transformers' torch path takes no initial "
    "state) and step single tokens in place: tree passes swap the module global for a scan that starts from "
    "the parent's state (same arguments), and hide that state from the mixer (layer_idx, the cache's "
    "recurrent state) so it always takes the scan; from 5.25 the mixer's mamba_scan_forward does this reading "
    "and storing, and steps a few last tokens one by one only where the cache asks for intermediate states "
    "(never for forkrl's layers)",
)
def _check_scan() -> None:
    import importlib
    import re

    for name in _SCAN_MODULES:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        assert parameter_names(getattr(module, _SCAN))[: len(_SCAN_ARGS)] == _SCAN_ARGS, name
        mixers = [v for k, v in vars(module).items() if k.endswith("MambaMixer") and isinstance(v, type)]
        assert mixers, name
        for mixer in mixers:
            assert parameter_names(mixer.forward) == _SCAN_MIXER_ARGS, mixer
            src = inspect.getsource(mixer.forward)
            if hasattr(module, _SCAN_FORWARD):
                assert re.search(rf"{_SCAN_FORWARD}\(\s*self,", src), mixer
                src = function_source(module, _SCAN_FORWARD)
                assert "cache.get_recurrent_state(module.layer_idx" in src, name
                assert "cache.update_recurrent_state(last_recurrent_state, module.layer_idx)" in src, name
            else:
                assert "cache.get_recurrent_state(self.layer_idx" in src, mixer
            assert f"{_SCAN}(" in src, mixer
    if hasattr(Cache, "get_recurrent_states_to_keep"):
        layer = LinearAttentionLayer(number_of_states=1)
        record_past(layer)
        assert Cache(layers=[layer]).get_recurrent_states_to_keep(0) == 0


def scan_mixers(model: nn.Module) -> list[nn.Module]:
    """The Mamba-1 mixers of ``model`` (for :func:`scan_replaced`), in layer order."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("MambaMixer")
        and type(m).__module__.rsplit(".", 1)[-1].removeprefix("modeling_") in _SCAN_MODULES
    ]


@contextlib.contextmanager
def scan_replaced(mixers: list[nn.Module], scan: Callable, before: Callable) -> Iterator[None]:
    """For the duration, the modules of ``mixers`` (:func:`scan_mixers`) call ``scan`` for
    :data:`_SCAN`, and ``before(mixer)`` runs before each mixer's forward (a forward pre-hook)."""
    import sys

    modules = list({id(m): m for m in (sys.modules[type(x).__module__] for x in mixers)}.values())
    saved = [(m, getattr(m, _SCAN)) for m in modules]
    handles = [x.register_forward_pre_hook(lambda mixer, args: before(mixer)) for x in mixers]
    for m, _ in saved:
        setattr(m, _SCAN, scan)
    try:
        yield
    finally:
        for m, fn in saved:
            setattr(m, _SCAN, fn)
        for h in handles:
            h.remove()


def mixer_layer(mixer: nn.Module) -> int:
    """The cache layer a Mamba-1 mixer reads (its ``layer_idx``)."""
    return mixer.layer_idx


def take_recurrent_state(cache: Cache, layer_idx: int) -> torch.Tensor | None:
    """Remove and return a state layer's recurrent state (None at the start of a path): the mixer
    then sees none, so it scans even a single token (no in-place step), and stores its final state
    through ``update_recurrent_state``."""
    layer = cache.layers[layer_idx]
    state = layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None
    layer.recurrent_states[0] = None
    layer.is_recurrent_states_initialized[0] = False
    return state


def next_recurrent_state(state: torch.Tensor | None) -> torch.Tensor | None:
    """The state :func:`_ssm_step` computed from ``state`` (None if it did not run on it)."""
    return getattr(state, "forkrl_next", None) if state is not None else None


# ---------------------------------------------------------------------------- multi-head latent attention

# What an MLA attention module (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite, Mistral 4, ...) must have
# for forkrl's latent split attention: its sizes, the up-projection and the expansion method.
_MLA_FIELDS = ("kv_b_proj", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_heads")


@_private(
    "<MLA attention>.expand_kv(kv_nope, k_rot) and kv_b_proj/kv_lora_rank/qk_nope_head_dim/qk_rope_head_dim/"
    "v_head_dim/num_heads",
    "MLA models cache the latent ([B, 1, n, kv_lora_rank] and the shared roped key [B, 1, n, rope]) and expand "
    "it into per-head keys/values after the cache returns it, so the ancestors' pieces attached to the cache's "
    "tensor never reach the attention function; for the duration of a split-attention pass each module's "
    "expand_kv is replaced (on the instance) by one that hands the latent itself to forkrl's attention",
)
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


# ---------------------------------------------------------------------------- torch ops


@_private(
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu (+ _backward)",
    "the CPU flash kernel returns the log-sum-exp, which the split attention merges across cache pieces; "
    "its backward takes the merged output and log-sum-exp (the ring-attention identity)",
)
def _check_flash_cpu() -> None:
    q = torch.randn(1, 2, 3, 8)
    out, lse = flash_cpu(q, q, q, 0.0, True, scale=0.5)[:2]
    assert out.shape == q.shape and lse.shape == (1, 2, 3)
    grads = flash_cpu_backward(torch.ones_like(out), q, q, q, out, lse, 0.0, True, scale=0.5)
    assert len(grads) == 3


def flash_cpu(*args, **kwargs):
    """``aten._scaled_dot_product_flash_attention_for_cpu``: ``(out [B, H, q, d], lse [B, H, q])``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, **kwargs)


def flash_cpu_backward(*args, **kwargs):
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward``: ``(dq, dk, dv)``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, **kwargs)


def has_flash_cuda() -> bool:
    """Whether this torch has the CUDA flash-attention ops (the check runs on a GPU only)."""
    aten = torch.ops.aten
    return hasattr(aten, "_scaled_dot_product_flash_attention") and hasattr(
        aten, "_scaled_dot_product_flash_attention_backward"
    )


def flash_cuda(q, k, v, dropout_p: float, is_causal: bool, scale: float | None = None):
    """``aten._scaled_dot_product_flash_attention`` (CUDA, bf16/fp16, ``[B, H, L, d]``, head dim <=
    256) in the CPU kernel's form: ``(out [B, H, q, d], lse [B, H, q] float32)``. Checked on the device
    at first use by :func:`forkrl.core.attention.split.kernels_for` (no GPU in CI)."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, False, scale=scale
    )
    return out[0], out[1]


def flash_cuda_backward(
    dout, q, k, v, out, lse, dropout_p: float, is_causal: bool, scale: float | None = None
):
    """``aten._scaled_dot_product_flash_attention_backward`` in the CPU kernel's form: ``(dq, dk, dv)``.

    Dense (not varlen) inputs: the cumulative lengths go in undefined (None), as the dense forward
    returns them. A defined tensor, even an empty one, selects the varlen kernel, which then refuses
    it ("cu_seqlens_q must have dtype int32": seen on an H200, torch 2.11). Without dropout the RNG
    state is unused.
    """
    if dropout_p:
        raise ValueError("forkrl calls the CUDA flash backward without dropout only")
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        is_causal,
        empty,
        empty,
        scale=scale,
    )


def efficient_cuda(q, k, v, attn_mask: torch.Tensor, scale: float | None = None):
    """``aten._scaled_dot_product_efficient_attention`` (CUDA; an additive ``attn_mask``; as many key
    as query heads) in the CPU flash kernel's form: ``(out [B, H, q, d], lse [B, H, q] float32)``.
    Its log-sum-exp comes padded to a multiple of 32 queries and is cut to ``q``. Checked on the
    device at first use by :func:`forkrl.core.attention.level.level_kernels_for` (no GPU in CI)."""
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_mask, True, 0.0, False, scale=scale
    )
    return out, lse[..., : q.shape[2]]


def efficient_cuda_backward(dout, q, k, v, out, lse, attn_mask: torch.Tensor, scale: float | None = None):
    """``aten._scaled_dot_product_efficient_attention_backward`` without dropout: ``(dq, dk, dv)``;
    ``lse`` (``[B, H, q]``) is padded back to the kernel's multiple of 32 queries."""
    pad = -lse.shape[-1] % 32
    if pad:
        lse = torch.nn.functional.pad(lse, (0, pad))
    seed = torch.empty(0, dtype=torch.int64, device=q.device)  # no dropout: the RNG state is unused
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, attn_mask, out, lse, seed, seed, 0.0, [True, True, True, False], False, scale=scale
    )
    return dq, dk, dv


@_private(
    "torch.ops.aten._convert_weight_to_int4pack(_for_cpu), _weight_int4pack_mm(_for_cpu), _weight_int8pack_mm",
    "the drafter's low-bit linear layers run torch's own weight-only kernels (tinygemm int4 groupwise, "
    "int8 per channel); where a kernel is missing the layer dequantizes instead",
)
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


# ---------------------------------------------------------------------------- FSDP2 (torch.distributed)


@_private(
    "torch.distributed.fsdp FSDPModule class layout and FSDPState._mp_policy",
    "fully_shard makes FSDP<Cls>(FSDPModule, Cls) classes; the tree step builds a plain Cls replica from the "
    "config and runs it in the param_dtype of the root's mixed-precision policy, as FSDP2's forward does",
)
def _check_fsdp2() -> None:
    from torch.distributed.fsdp import FSDPModule

    assert hasattr(FSDPModule, "_get_fsdp_state") and hasattr(FSDPModule, "unshard")


def is_fsdp2_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def fsdp2_plain_class(module: nn.Module) -> type | None:
    """The class ``fully_shard`` wrapped (``FSDPLlamaForCausalLM`` -> ``LlamaForCausalLM``), or None."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None
    return next(c for c in type(module).__mro__[1:] if not issubclass(c, FSDPModule) and c is not object)


def fsdp2_param_dtype(module: nn.Module) -> torch.dtype | None:
    """The forward dtype of the root's mixed-precision policy (None: the parameters' own)."""
    state = module._get_fsdp_state()
    policy = getattr(state, "_mp_policy", None)
    return getattr(policy, "param_dtype", None)


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def dtensor_mesh(t: torch.Tensor):
    return t.device_mesh


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly sharded) parameter: an all-gather for a DTensor."""
    return t.full_tensor() if is_dtensor(t) else t


def reduce_scatter_like(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Sum the full ``grad`` of every rank and keep this rank's shard, in ``param``'s placement."""
    if not is_dtensor(param):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(grad)
        return grad
    from torch.distributed.tensor import DTensor, Partial

    mesh = param.device_mesh
    partial = DTensor.from_local(grad, mesh, [Partial()] * mesh.ndim, run_check=False)
    return partial.redistribute(mesh, param.placements)


# ---------------------------------------------------------------------------- DeepSpeed ZeRO-3
# Read by attribute only (core imports no host library): the gather itself is the plugin's
# (forkrl.plugins.deepspeed), whose contract test checks these attributes on real partitions.


def is_zero3_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DeepSpeed ZeRO-3 partitioned parameter."""
    return hasattr(p, "ds_id")


def whole_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's whole shape (a ZeRO-3 partition's ``ds_shape``, else its own)."""
    shape = getattr(p, "ds_shape", None)
    return p.shape if shape is None else torch.Size(shape)


def engine_hooks_of(module: nn.Module, package: str) -> list[tuple[dict, object]]:
    """The forward/backward hooks on ``module`` and its submodules registered by code of
    ``package`` (e.g. DeepSpeed's ZeRO-3 gather hooks), as ``(hook dict, key)`` pairs."""
    found = []
    for sub in module.modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
            hooks = getattr(sub, attr, None) or {}
            for key, fn in hooks.items():
                owner = getattr(fn, "__module__", None) or ""
                if owner.split(".")[0] == package:
                    found.append((hooks, key))
    return found


def set_tensor(module: nn.Module, name: str, value: torch.Tensor, parameter: bool) -> None:
    """Put ``value`` at dotted ``name`` as a parameter or a buffer (replacing what is there)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if parameter:
        owner._parameters[leaf] = value
    else:
        owner._buffers[leaf] = value
