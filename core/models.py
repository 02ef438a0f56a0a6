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
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

logger = logging.getLogger(__name__)

__all__ = ["ModelAdapter", "NodeKV", "UnsupportedModelError"]

# Past key/value of one layer: ([1, kv_heads, ctx, head_dim], same) pieces, one per ancestor node.
LayerPast = list[tuple[torch.Tensor, torch.Tensor]]


class UnsupportedModelError(ValueError):
    """The model cannot run on a prefix tree in the requested mode."""


class _RecordingLayer(DynamicLayer):
    """Full-attention layer that also keeps the keys/values of the current forward."""

    new_keys: torch.Tensor | None = None
    new_values: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: D102
        self.new_keys, self.new_values = key_states, value_states
        return super().update(key_states, value_states, *args, **kwargs)


class _RecordingSlidingLayer(DynamicSlidingWindowLayer):
    """Sliding-window layer that also keeps the keys/values of the current forward."""

    new_keys: torch.Tensor | None = None
    new_values: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: D102
        self.new_keys, self.new_values = key_states, value_states
        return super().update(key_states, value_states, *args, **kwargs)


@dataclass
class NodeKV:
    """Keys/values one node adds, per layer: ``[1, kv_heads, node_len, head_dim]`` each."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values]


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
            else:
                self.layer_kinds.append(type(layer).__name__)
                logger.debug("layer %d of %s has cache layer %s", i, name, type(layer).__name__)
        unsupported = sorted({k for k in self.layer_kinds if k not in ("full", "sliding")})
        self.has_state = bool(unsupported)
        if unsupported:
            raise UnsupportedModelError(
                f"{name} has cache layers of kind {unsupported} (convolution/recurrent state or indexed "
                "attention), which this executor cannot yet rebuild per tree node: train this model without "
                "tree_packing"
            )
        self.attn_implementation = getattr(base.config, "_attn_implementation", None)

    # ------------------------------------------------------------------ caches
    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def make_cache(self, past: list[LayerPast], past_len: int) -> DynamicCache:
        """A fresh cache holding ``past`` (per layer, the ancestors' key/value pieces).

        The pieces are concatenated here (out of place), so gradient reaches every piece; a cache
        is never reused after a forward appended to it.
        """
        cache = DynamicCache(config=self.base.config)
        layers = []
        for i, kind in enumerate(self.layer_kinds):
            if kind == "sliding":
                window = cache.layers[i].sliding_window
                layer = _RecordingSlidingLayer(sliding_window=window)
            else:
                layer = _RecordingLayer()
            if past_len > 0:
                keys = _cat_past([k for k, _ in past[i]])
                values = _cat_past([v for _, v in past[i]])
                if kind == "sliding":
                    keep = window - 1
                    keys, values = keys[:, :, -keep:, :], values[:, :, -keep:, :]
                    layer.cumulative_length = past_len
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
            layers.append(layer)
        cache.layers = layers
        return cache

    @staticmethod
    def recorded(cache: DynamicCache) -> NodeKV:
        """The keys/values the last forward through ``cache`` added."""
        return NodeKV(
            keys=[layer.new_keys for layer in cache.layers],
            values=[layer.new_values for layer in cache.layers],
        )

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
