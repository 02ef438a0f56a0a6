"""What the executor needs from a transformers causal LM, and the caches it builds for each node.

A node is forwarded with the key/value tensors of its ancestors (as leaf tensors, so gradients
reach them) in a cache built fresh for that forward. The cache layers below record the node's own
new key/value tensors as the forward produces them, so the executor can hand them to the node's
descendants and, on the way back, push the gradient the descendants accumulated into them.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
)

from .attention import PastPieces

logger = logging.getLogger(__name__)

__all__ = ["ModelAdapter", "NodeKV", "UnsupportedModelError"]

# What the ancestors left in one layer, one tuple per ancestor: attention layers ([1, kv_heads, n,
# head_dim] keys, values) pieces that concatenate; state layers (conv [1, C, k], recurrent or absent)
# of which only the nearest ancestor's counts.
LayerPast = list[tuple[torch.Tensor, ...]]


class UnsupportedModelError(ValueError):
    """The model cannot run on a prefix tree in the requested mode."""


class _Recording:
    """Cache-layer mixin that also keeps the keys/values of the current forward."""

    new_keys: torch.Tensor | None = None
    new_values: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: D102
        self.new_keys, self.new_values = key_states, value_states
        return super().update(key_states, value_states, *args, **kwargs)


class _RecordingLayer(_Recording, DynamicLayer):
    """Full-attention layer that records its new keys/values."""


class _PiecewiseLayer(_RecordingLayer):
    """Full-attention layer that keeps the ancestors' keys/values as separate pieces.

    ``update`` returns only the node's own keys/values, with the pieces attached for
    :func:`forkrl.core.attention.split_attention`; no context-sized tensor is concatenated.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], past_len: int) -> None:
        super().__init__()
        self.pieces = PastPieces(keys, values)
        self.past_len = past_len

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: D102
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.new_keys, self.new_values = key_states, value_states
        if self.past_len == 0:
            return key_states, value_states
        keys = key_states.view_as(key_states)  # an alias to carry the pieces, not the recorded tensor
        keys.forkrl_past = self.pieces
        return keys, value_states

    def get_seq_length(self) -> int:  # noqa: D102
        return self.past_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:  # noqa: D102
        return self.past_len + query_length, 0


class _RecordingSlidingLayer(_Recording, DynamicSlidingWindowLayer):
    """Sliding-window layer that records its new keys/values."""


class _RecordingStateLayer(LinearAttentionLayer):
    """Conv/recurrent-state layer whose updates are out of place and recorded.

    transformers updates these states in place (``copy_``, and a fused single-token conv step),
    which breaks autograd through a state restored from a leaf tensor. Recording the past makes
    the model take its out-of-place multi-token path for every length; the recurrent state is
    assigned instead of copied.
    """

    def __init__(self) -> None:
        super().__init__(number_of_states=1)
        self.record_past = True
        self.new_conv: torch.Tensor | None = None
        self.new_recurrent: torch.Tensor | None = None
        self.kernel: int | None = None

    def set_past(self, conv: torch.Tensor, recurrent: torch.Tensor | None) -> None:
        self.device, self.dtype = conv.device, conv.dtype
        self.conv_states[0] = conv
        self.is_conv_states_initialized[0] = True
        self.has_previous_state[0] = True
        if recurrent is not None:
            self.recurrent_states[0] = recurrent
            self.is_recurrent_states_initialized[0] = True

    def update_conv_state(self, conv_states, state_idx=0, conv_kernel_size=None, **kwargs):  # noqa: D102
        if state_idx != 0:
            raise UnsupportedModelError("forkrl supports one conv state per layer")
        if self.device is None:
            self.device, self.dtype = conv_states.device, conv_states.dtype
        if conv_kernel_size is not None:
            self.kernel = conv_kernel_size
        if self.has_previous_state[0]:
            full = torch.cat([self.conv_states[0], conv_states], dim=-1)
        else:
            full = conv_states
        self.conv_states[0] = full
        self.is_conv_states_initialized[0] = True
        self.has_previous_state[0] = True
        # The next node needs only the last kernel-size inputs (fewer when the path is shorter:
        # the conv zero-pads the rest, as it does at the start of a sequence).
        self.new_conv = full if self.kernel is None else full[..., -self.kernel :]
        return full

    def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):  # noqa: D102
        self.recurrent_states[0] = recurrent_states
        self.is_recurrent_states_initialized[0] = True
        self.new_recurrent = recurrent_states
        return recurrent_states


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


class ModelAdapter:
    """Splits a causal LM into decoder and LM head and builds tree caches for it.

    Args:
        model: a transformers causal LM (``*ForCausalLM``), optionally wrapped by PEFT.

    Raises:
        UnsupportedModelError: when the model has no decoder/LM-head split, its forward takes no
            external cache or position ids, or a layer's cache kind is not supported.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.base = base
        name = type(base).__name__
        get_decoder = getattr(base, "get_decoder", None)
        decoder = get_decoder() if callable(get_decoder) else None
        head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        if decoder is None or decoder is base or head is None:
            raise UnsupportedModelError(
                f"{name} has no separate decoder and LM head (get_decoder()/get_output_embeddings()): forkrl's "
                "tree executor needs a transformers *ForCausalLM model; train this model without tree_packing"
            )
        self.decoder = decoder
        self.head = head
        self.config = base.config.get_text_config(decoder=True)
        params = inspect.signature(decoder.forward).parameters
        if "cache" in params:
            self.cache_kwarg = "cache"
        elif "past_key_values" in params:
            self.cache_kwarg = "past_key_values"
        else:
            raise UnsupportedModelError(
                f"{type(decoder).__name__}.forward takes no cache argument, so ancestors' keys/values cannot be "
                "passed in: use TreeExecutor(mode='packed') if the model is attention-only, or train without "
                "tree_packing"
            )
        if "position_ids" not in params:
            raise UnsupportedModelError(
                f"{type(decoder).__name__}.forward takes no position_ids; tree nodes need explicit positions: "
                "train this model without tree_packing"
            )
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.logit_scale = getattr(self.config, "logit_scale", None)
        probe = DynamicCache(config=base.config)
        self.layer_kinds: list[str] = []
        for i, layer in enumerate(probe.layers):
            if type(layer) is DynamicLayer:
                self.layer_kinds.append("full")
            elif type(layer) is DynamicSlidingWindowLayer:
                self.layer_kinds.append("sliding")
            elif type(layer) is LinearAttentionLayer:
                self.layer_kinds.append("state")
            else:
                self.layer_kinds.append(type(layer).__name__)
                logger.debug("layer %d of %s has cache layer %s", i, name, type(layer).__name__)
        unsupported = sorted({k for k in self.layer_kinds if k not in ("full", "sliding", "state")})
        self.has_state = "state" in self.layer_kinds
        if unsupported:
            raise UnsupportedModelError(
                f"{name} has cache layers of kind {unsupported} (e.g. indexed attention or layers mixing "
                "attention and recurrent state), which forkrl cannot rebuild per tree node: train this model "
                "without tree_packing"
            )
        self.attn_implementation = getattr(base.config, "_attn_implementation", None)

    # ------------------------------------------------------------------ caches
    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def make_cache(
        self, past: list[LayerPast], past_len: int, batch: int = 1, pieces: bool = False
    ) -> DynamicCache:
        """A fresh cache holding ``past`` (per layer, the ancestors' key/value pieces).

        The pieces are concatenated here (out of place), so gradient reaches every piece; a cache
        is never reused after a forward appended to it. ``batch`` > 1 shares the past among that
        many sequences (broadcast, no copy until the forward appends). ``pieces=True`` (only with
        :func:`forkrl.core.attention.split_attention` selected) keeps them separate instead, so no
        copy of the context is made at all.
        """
        cache = DynamicCache(config=self.base.config)
        layers = []
        for i, kind in enumerate(self.layer_kinds):
            if kind == "state":
                layer = _RecordingStateLayer()
                if past_len > 0:
                    nearest = [_batched(t, batch, copy=True) for t in past[i][-1]]
                    layer.set_past(nearest[0], nearest[1] if len(nearest) > 1 else None)
                layers.append(layer)
                continue
            if pieces and kind == "full":
                keys = [_batched(kv[0], batch) for kv in past[i]] if past_len > 0 else []
                values = [_batched(kv[1], batch) for kv in past[i]] if past_len > 0 else []
                layers.append(_PiecewiseLayer(keys, values, past_len))
                continue
            if kind == "sliding":
                window = cache.layers[i].sliding_window
                layer = _RecordingSlidingLayer(sliding_window=window)
            else:
                layer = _RecordingLayer()
            if past_len > 0:
                keys = _cat_past([kv[0] for kv in past[i]])
                values = _cat_past([kv[1] for kv in past[i]])
                if kind == "sliding":
                    keep = window - 1
                    keys, values = keys[:, :, -keep:, :], values[:, :, -keep:, :]
                    layer.cumulative_length = past_len
                keys, values = _batched(keys, batch), _batched(values, batch)
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
            layers.append(layer)
        cache.layers = layers
        return cache

    @staticmethod
    def recorded(cache: DynamicCache) -> NodeKV:
        """What the last forward through ``cache`` added (see :class:`NodeKV`)."""
        out: list[tuple[torch.Tensor, ...]] = []
        for layer in cache.layers:
            if isinstance(layer, _RecordingStateLayer):
                if layer.new_conv is None:
                    raise UnsupportedModelError(
                        "a conv/recurrent layer did not update its state through the cache; forkrl cannot "
                        "carry its state between tree nodes: train this model without tree_packing"
                    )
                state = (
                    (layer.new_conv,)
                    if layer.new_recurrent is None
                    else (layer.new_conv, layer.new_recurrent)
                )
                out.append(state)
            else:
                out.append((layer.new_keys, layer.new_values))
        return NodeKV(out)

    # ------------------------------------------------------------------ forward pieces
    def hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states (after the last norm).

        Args:
            input_ids: ``[1, n]``.
            position_ids: ``[1, n]``.
            cache: ancestors' keys/values, or None.
            attention_mask: optional 4D mask ``[1, 1, n, ctx + n]`` (packed mode).

        Returns:
            ``[1, n, hidden]``.
        """
        kwargs = {self.cache_kwarg: cache, "use_cache": cache is not None}
        out = self.decoder(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **kwargs
        )
        if cache is not None:
            for layer in cache.layers:
                if isinstance(layer, _PiecewiseLayer) and layer.past_len > 0 and layer.pieces.used != 1:
                    raise UnsupportedModelError(
                        f"{type(self.base).__name__}'s attention did not receive the keys its cache returned "
                        f"(used the ancestors' cache {layer.pieces.used} times, expected once), so forkrl's "
                        "mask-free attention cannot run in it: use TreeExecutor(split_attention=False)"
                    )
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def logits(self, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
        """LM head on ``[rows, hidden]`` -> float ``[rows, vocab]`` logits, scaled like the model and host."""
        logits = self.head(hidden)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        return logits

    # ------------------------------------------------------------------ model state
    @contextlib.contextmanager
    def checkpointing_off(self) -> Iterator[bool]:
        """Turn transformers' gradient checkpointing off for the duration (it drops the cache).

        Yields whether it was on. Replay mode is itself a checkpointing scheme.
        """
        mods = [m for m in self.model.modules() if getattr(m, "gradient_checkpointing", False) is True]
        for m in mods:
            m.gradient_checkpointing = False
        try:
            yield bool(mods)
        finally:
            for m in mods:
                m.gradient_checkpointing = True

    def split_attention_ok(self, device: torch.device) -> bool:
        """Whether :mod:`forkrl.core.attention` can replace the model's sdpa in tree passes."""
        return (
            device.type == "cpu"
            and self.attn_implementation == "sdpa"
            and all(k in ("full", "state") for k in self.layer_kinds)
            and getattr(self.config, "attn_logit_softcapping", None) is None
        )

    @contextlib.contextmanager
    def attention_implementation(self, name: str | None) -> Iterator[None]:
        """Use attention implementation ``name`` for the duration (None: leave the model's)."""
        if name is None:
            yield
            return
        configs = list({id(c): c for c in (self.base.config, self.config)}.values())
        old = [c._attn_implementation for c in configs]
        for c in configs:
            c._attn_implementation = name
        try:
            yield
        finally:
            for c, o in zip(configs, old, strict=True):
                c._attn_implementation = o

    def has_dropout(self) -> bool:
        """Whether a forward in the current mode draws random numbers (training with dropout > 0)."""
        if not self.model.training:
            return False
        for m in self.model.modules():
            if isinstance(m, nn.Dropout) and m.p > 0:
                return True
        for name in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop"):
            if float(getattr(self.config, name, 0.0) or 0.0) > 0:
                return True
        return False
