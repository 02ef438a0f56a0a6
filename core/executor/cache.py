"""The caches a tree node is forwarded with, and what the node leaves in them.

A node is forwarded with the key/value tensors of its ancestors (as leaf tensors, so gradients
reach them) in a cache built fresh for that forward. The cache layers below record the node's own
new key/value tensors as the forward produces them, so the executor can hand them to the node's
descendants and, on the way back, push the gradient the descendants accumulated into them.
transformers' internals are reached through :mod:`forkrl.core.compat`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import compat
from ..attention import PastPieces
from ..attention.level import LevelMasks, LevelPast
from ..errors import UnsupportedModelError

__all__ = ["LayerPast", "NodeKV", "build_cache", "build_level_cache", "recorded"]

# What the ancestors left in one layer, one tuple per ancestor: attention layers ([1, kv_heads, n,
# head_dim] keys, values) pieces that concatenate; state layers (conv [1, C, k], recurrent or absent)
# of which only the nearest ancestor's counts.
LayerPast = list[tuple[torch.Tensor, ...]]


class _Recording:
    """Cache-layer mixin that also keeps the keys/values of the current forward."""

    new_keys: torch.Tensor | None = None
    new_values: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: D102
        self.new_keys, self.new_values = key_states, value_states
        return super().update(key_states, value_states, *args, **kwargs)


class RecordingLayer(_Recording, compat.DynamicLayer):
    """Full-attention layer that records its new keys/values."""


class _CarryingLayer(RecordingLayer):
    """Full-attention layer whose ``update`` returns only the forward's own keys/values, an alias of
    the keys carrying the ancestors as attribute ``attr`` (None: nothing to carry), for
    :func:`forkrl.core.attention.level.tree_attention`; no context-sized tensor is concatenated."""

    attr = ""

    def __init__(self, carried, past_len: int) -> None:
        super().__init__()
        self.carried = carried
        self.past_len = past_len

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: D102
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.new_keys, self.new_values = key_states, value_states
        if self.carried is None:
            return key_states, value_states
        keys = key_states.view_as(key_states)  # an alias to carry them, not the recorded tensor
        setattr(keys, self.attr, self.carried)
        return keys, value_states

    def get_seq_length(self) -> int:  # noqa: D102
        return self.past_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:  # noqa: D102
        return self.past_len + query_length, 0


class PiecewiseLayer(_CarryingLayer):
    """A depth-first unit's layer: the ancestors' keys/values as separate pieces
    (:class:`PastPieces`, ``key.forkrl_past``)."""

    attr = "forkrl_past"

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], past_len: int) -> None:
        self.pieces = PastPieces(keys, values)
        super().__init__(self.pieces if past_len > 0 else None, past_len)


class LevelLayer(_CarryingLayer):
    """A level run's layer (:mod:`.levels`): the units' ancestors per depth (:class:`LevelPast`,
    ``key.forkrl_level``; none at the roots' depth) beside the run's ``[N, kv, W, d]`` keys."""

    attr = "forkrl_level"

    def __init__(self, past: LevelPast, past_len: int) -> None:
        self.past = past
        super().__init__(past, past_len)


class RecordingSlidingLayer(_Recording, compat.DynamicSlidingWindowLayer):
    """Sliding-window layer that records its new keys/values."""


class _StateRecording:
    """Conv/recurrent-state layer mixin whose updates are out of place and recorded.

    transformers updates these states in place (``copy_``, and a fused single-token conv step),
    which breaks autograd through a state restored from a leaf tensor. Recording the past makes
    the model take its out-of-place multi-token path for every length; the recurrent state is
    assigned instead of copied.
    """

    def _start_recording(self) -> None:
        compat.record_past(self)
        self.new_conv: torch.Tensor | None = None
        self.new_recurrent: torch.Tensor | None = None
        self.seeded_recurrent: torch.Tensor | None = None  # the parent's state, as handed to the model
        self.kernel: int | None = None

    def update_conv_state(self, conv_states, state_idx=0, conv_kernel_size=None, **kwargs):  # noqa: D102
        if state_idx != 0:
            raise UnsupportedModelError("forkrl supports one conv state per layer")
        if conv_kernel_size is not None:
            self.kernel = conv_kernel_size
        past = compat.conv_past(self)
        full = conv_states if past is None else torch.cat([past, conv_states], dim=-1)
        compat.store_conv_state(self, full)
        # The next node needs only the last kernel-size inputs (fewer when the path is shorter:
        # the conv zero-pads the rest, as it does at the start of a sequence).
        self.new_conv = full if self.kernel is None else full[..., -self.kernel :]
        return full

    def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):  # noqa: D102
        compat.store_recurrent_state(self, recurrent_states)
        self.new_recurrent = recurrent_states
        return recurrent_states


class RecordingStateLayer(_StateRecording, compat.LinearAttentionLayer):
    """Conv/recurrent-state layer (see :class:`_StateRecording`)."""

    def __init__(self) -> None:
        super().__init__(number_of_states=1)
        self._start_recording()


class RecordingMixedLayer(_Recording, _StateRecording, compat.LinearAttentionAndFullAttentionLayer):
    """A layer holding attention keys/values and a conv/recurrent state side by side (Falcon-H1's
    parallel attention and Mamba, Zamba2's hybrid layers): both recorded."""

    def __init__(self) -> None:
        super().__init__(number_of_states=1)
        self._start_recording()


@dataclass
class NodeKV:
    """What one node leaves in the cache, per layer: ``(keys, values)`` of its own tokens
    (``[1, kv_heads, node_len, head_dim]``) for attention layers, ``(conv,)`` or
    ``(conv, recurrent)`` final states for conv/recurrent layers."""

    layers: list[tuple[torch.Tensor, ...]]

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer]

    def detached(self, requires_grad: bool) -> NodeKV:
        """Leaf copies for the descendants. A tensor that views a larger buffer (values sliced out
        of a fused QKV projection, say) is copied, so the buffer is not kept alive with it."""
        return NodeKV([tuple(_own(t).requires_grad_(requires_grad) for t in lay) for lay in self.layers])


def _own(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t


def _batched(t: torch.Tensor, batch: int, copy: bool = False) -> torch.Tensor:
    if batch == 1:
        return t
    t = t.expand(batch, *t.shape[1:])
    return t.contiguous() if copy else t


def _cat_past(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)


def _state_layer(past: LayerPast, past_len: int, batch: int, layer=None):
    layer = layer if layer is not None else RecordingStateLayer()
    if past_len > 0:
        nearest = [_batched(t, batch, copy=True) for t in past[-1]]
        recurrent = None
        if len(nearest) > 1:  # an alias per forward: a one-token SSM step leaves its result on it
            recurrent = layer.seeded_recurrent = nearest[1].view_as(nearest[1])
        compat.seed_state_layer(layer, nearest[0], recurrent, past_len)
    return layer


def _attention_layer(kind: str, past: LayerPast, past_len: int, batch: int, window: int | None):
    layer = RecordingSlidingLayer(sliding_window=window) if kind == "sliding" else RecordingLayer()
    if past_len == 0:
        return layer
    keys = _cat_past([kv[0] for kv in past])
    values = _cat_past([kv[1] for kv in past])
    if kind == "sliding":
        keep = window - 1
        keys, values = _batched(keys[:, :, -keep:, :], batch), _batched(values[:, :, -keep:, :], batch)
        compat.seed_sliding_layer(layer, keys, values, past_len)
    else:
        compat.seed_layer(layer, _batched(keys, batch), _batched(values, batch))
    return layer


def build_cache(
    config, layer_kinds: list[str], past: list[LayerPast], past_len: int, batch: int = 1, pieces: bool = False
) -> compat.DynamicCache:
    """A fresh cache holding ``past`` (per layer, the ancestors' key/value pieces).

    The pieces are concatenated here (out of place), so gradient reaches every piece; a cache
    is never reused after a forward appended to it. ``batch`` > 1 shares the past among that
    many sequences (broadcast, no copy until the forward appends). ``pieces=True`` (only with
    :func:`forkrl.core.attention.split_attention` selected) keeps them separate instead, so no
    copy of the context is made at all.

    Args:
        config: the model's config (the cache's sliding windows are read from it).
        layer_kinds: per layer ``"full"``, ``"sliding"``, ``"state"`` or ``"none"`` (no cache).
        past: per layer, the ancestors' tensors (see :data:`LayerPast`).
        past_len: positions the ancestors hold.
    """
    template = compat.DynamicCache(config=config)
    layers = []
    for i, kind in enumerate(layer_kinds):
        if kind == "none":
            layers.append(compat.DummyLayer())
        elif kind == "mixed":  # (keys, values, conv[, recurrent]) per ancestor
            layer = RecordingMixedLayer()
            if past_len > 0:
                keys = _cat_past([p[0] for p in past[i]])
                values = _cat_past([p[1] for p in past[i]])
                compat.seed_layer(layer, _batched(keys, batch), _batched(values, batch))
            layers.append(_state_layer([p[2:] for p in past[i]], past_len, batch, layer))
        elif kind == "state":
            layers.append(_state_layer(past[i], past_len, batch))
        elif pieces and kind == "full":
            # Shared by the whole batch as they are: split attention folds the batch into its queries.
            keys = [kv[0] for kv in past[i]] if past_len > 0 else []
            values = [kv[1] for kv in past[i]] if past_len > 0 else []
            layers.append(PiecewiseLayer(keys, values, past_len))
        else:
            window = getattr(template.layers[i], "sliding_window", None)
            layers.append(_attention_layer(kind, past[i], past_len, batch, window))
    compat.replace_layers(template, layers)
    return template


def build_level_cache(
    config, layer_kinds: list[str], ancestors: list[NodeKV], masks: LevelMasks
) -> compat.DynamicCache:
    """A fresh cache for a level run: per layer, each ancestor depth's batch of keys/values.

    Args:
        layer_kinds: ``"full"`` or ``"none"`` per layer (a level pass runs attention-only models).
        ancestors: per ancestor depth (root first), that depth's recorded ``[N_j, kv, W_j, d]``
            keys/values (leaf tensors).
        masks: which ancestor each unit has at each depth and how long it is (empty at the roots).
    """
    template = compat.DynamicCache(config=config)
    past_len = sum(masks.widths)
    layers = []
    for i, kind in enumerate(layer_kinds):
        if kind == "none":
            layers.append(compat.DummyLayer())
            continue
        keys = [a.layers[i][0] for a in ancestors]
        layers.append(LevelLayer(LevelPast(keys, [a.layers[i][1] for a in ancestors], masks), past_len))
    compat.replace_layers(template, layers)
    return template


def recorded(cache: compat.DynamicCache) -> NodeKV:
    """What the last forward through ``cache`` added (see :class:`NodeKV`)."""
    out: list[tuple[torch.Tensor, ...]] = []
    for layer in cache.layers:
        if isinstance(layer, compat.DummyLayer):
            out.append(())
            continue
        attention = () if isinstance(layer, RecordingStateLayer) else (layer.new_keys, layer.new_values)
        if not isinstance(layer, _StateRecording):
            out.append(attention)
            continue
        if layer.new_conv is None:
            raise UnsupportedModelError(
                "a conv/recurrent layer did not update its state through the cache; forkrl cannot "
                "carry its state between tree nodes: train this model without tree_packing"
            )
        recurrent = layer.new_recurrent
        if recurrent is None:  # a Mamba-2 one-token step (compat.out_of_place_ssm_step)
            recurrent = compat.next_recurrent_state(layer.seeded_recurrent)
        out.append(attention + ((layer.new_conv,) if recurrent is None else (layer.new_conv, recurrent)))
    return NodeKV(out)


def check_pieces_used(cache: compat.DynamicCache, model_name: str) -> None:
    """Raise when a model's attention did not consume the ancestors' pieces exactly once."""
    for layer in cache.layers:
        used = layer.past.used if isinstance(layer, LevelLayer) else 1
        if isinstance(layer, PiecewiseLayer) and layer.past_len > 0:
            used = layer.pieces.used
        if used != 1:
            raise UnsupportedModelError(
                f"{model_name}'s attention did not receive the keys its cache returned (used the ancestors' "
                f"cache {used} times, expected once), so forkrl's mask-free attention cannot run "
                "in it: use TreeExecutor(split_attention=False)"
            )
