"""transformers' cache layers: a fresh cache per tree node whose layers are seeded from the
ancestors' tensors (full attention, sliding window, conv/recurrent state) without copying."""

from __future__ import annotations

import torch
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from .registry import CHECKED, Private, parameter_names

# The cache classes are transformers' own, re-exported so core names them through compat.
__all__ = [
    "Cache",
    "DummyLayer",
    "DynamicCache",
    "DynamicLayer",
    "DynamicSlidingWindowLayer",
    "LinearAttentionAndFullAttentionLayer",
    "LinearAttentionLayer",
    "conv_past",
    "init_cache",
    "mark_initialized",
    "record_past",
    "replace_layers",
    "seed_layer",
    "seed_sliding_layer",
    "seed_state_layer",
    "store_conv_state",
    "store_recurrent_state",
]

try:  # transformers >= 5.2x: the cache layer of layers that keep nothing (MLP-only layers)
    from transformers.cache_utils import DummyLayer
except ImportError:  # older (the veRL and OpenRLHF pins): no model builds one

    class DummyLayer:  # type: ignore[no-redef]
        """Stand-in: no cache layer of this type exists in this transformers."""


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


#: This area's entries (checked by ``tests/core/test_compat.py``).
PRIVATES: tuple[Private, ...] = (
    Private(
        "transformers",
        "DynamicCache(config=...).layers",
        "the executor builds a fresh cache per tree node and replaces its layers with forkrl's recording "
        "layers seeded from the ancestors' tensors; the layer types tell attention, sliding and state layers apart",
        _check_cache_layers,
        CHECKED,
    ),
    Private(
        "transformers",
        "DynamicLayer.lazy_initialization/is_initialized/keys/values",
        "a node's cache layer is seeded with its ancestors' keys/values (leaf tensors) without copying; "
        "the sampler's fixed-capacity layer allocates its own buffers",
        _check_dynamic_layer,
        CHECKED,
    ),
    Private(
        "transformers",
        "DynamicSlidingWindowLayer.sliding_window/cumulative_length",
        "a sliding-window node is seeded with only the last window - 1 ancestor positions, and the layer must "
        "still count every position before it for its mask",
        _check_sliding_layer,
        CHECKED,
    ),
    Private(
        "transformers",
        "LinearAttentionLayer fields (conv_states, recurrent_states, has_previous_state, record_past, ...) and "
        "update_conv_state/update_recurrent_state",
        "hybrid conv/recurrent layers (LFM2, Qwen3-Next) keep state in these; forkrl seeds a node's state from "
        "its parent's leaf tensors and overrides the updates to be out of place (transformers copies in place, "
        "which breaks autograd through a restored state); record_past makes the model take its multi-token path",
        _check_state_layer,
        CHECKED,
    ),
)
