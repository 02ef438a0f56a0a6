"""What the executor needs from a transformers causal LM: decoder, LM head, cache kinds, switches."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import Literal, get_args

import torch
from torch import nn

from .. import compat
from ..attention import NAME as SPLIT_ATTENTION
from ..attention import compute_dtype, deferred_expand
from ..errors import UnsupportedModelError
from .cache import LayerPast, build_cache, check_pieces_used
from .scan import continuing

logger = logging.getLogger(__name__)

__all__ = ["HEAD_PRECISIONS", "HeadPrecision", "ModelAdapter", "UnsupportedModelError"]

HeadPrecision = Literal["model", "fp32_accumulate", "fp32"]
HEAD_PRECISIONS: tuple[str, ...] = get_args(HeadPrecision)

_KINDS = {
    compat.DynamicLayer: "full",
    compat.DynamicSlidingWindowLayer: "sliding",
    compat.LinearAttentionLayer: "state",
    compat.LinearAttentionAndFullAttentionLayer: "mixed",  # attention and recurrent state side by side
    compat.DummyLayer: "none",  # no cache (MLP-only layers)
}


def _split(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(base model, decoder, LM head) of a causal LM, PEFT-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_decoder = getattr(base, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if decoder is None or decoder is base or head is None:
        raise UnsupportedModelError(
            f"{type(base).__name__} has no separate decoder and LM head (get_decoder()/get_output_embeddings()): "
            "forkrl's tree executor needs a transformers *ForCausalLM model; train this model without tree_packing"
        )
    return base, decoder, head


def _cache_kwarg(decoder: nn.Module) -> str:
    params = inspect.signature(decoder.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise UnsupportedModelError(
        f"{type(decoder).__name__}.forward takes no cache argument, so ancestors' keys/values cannot be "
        "passed in: use TreeExecutor(mode='packed') if the model is attention-only, or train without tree_packing"
    )


def _takes_positions(decoder: nn.Module, kinds: list[str]) -> bool:
    """Whether the decoder is given position ids. A decoder that takes none is run without them
    when it has no positional encoding at all: only conv/recurrent layers (position is the order
    of the state's updates, which the cache carries) and no embedding beside the tokens'."""
    if "position_ids" in inspect.signature(decoder.forward).parameters:
        return True
    embeddings = [m for m in decoder.modules() if isinstance(m, nn.Embedding)]
    if set(kinds) <= {"state", "none"} and "state" in kinds and len(embeddings) <= 1:
        return False
    raise UnsupportedModelError(
        f"{type(decoder).__name__}.forward takes no position_ids; tree nodes need explicit positions: "
        "train this model without tree_packing"
    )


def _layer_kinds(base: nn.Module) -> list[str]:
    try:
        layers = compat.DynamicCache(config=base.config).layers
    except (AttributeError, TypeError, ValueError) as err:  # e.g. BLT's config: no num_hidden_layers
        raise UnsupportedModelError(
            f"transformers cannot build a cache from {type(base).__name__}'s config ({type(err).__name__}: {err}), "
            "so forkrl cannot rebuild it per tree node: train this model without tree_packing"
        ) from err
    kinds = [_KINDS.get(type(layer), type(layer).__name__) for layer in layers]
    unsupported = sorted({k for k in kinds if k not in ("full", "sliding", "state", "mixed", "none")})
    if unsupported:
        raise UnsupportedModelError(
            f"{type(base).__name__} has cache layers of kind {unsupported} (e.g. indexed attention or layers mixing "
            "attention and recurrent state), which forkrl cannot rebuild per tree node: train this model without "
            "tree_packing"
        )
    return kinds


class ModelAdapter:
    """Splits a causal LM into decoder and LM head and builds tree caches for it.

    Args:
        model: a transformers causal LM (``*ForCausalLM``), optionally wrapped by PEFT.

    Raises:
        UnsupportedModelError: when the model has no decoder/LM-head split, its forward takes no
            external cache, or no position ids while it has attention layers or position
            embeddings, or a layer's cache kind is not supported.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.base, self.decoder, self.head = _split(model)
        self.config = self.base.config.get_text_config(decoder=True)
        self.cache_kwarg = _cache_kwarg(self.decoder)
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.logit_scale = getattr(self.config, "logit_scale", None)
        self.layer_kinds = _layer_kinds(self.base)
        self.takes_positions = _takes_positions(self.decoder, self.layer_kinds)
        self.has_state = "state" in self.layer_kinds or "mixed" in self.layer_kinds
        self.ssm_modules = compat.ssm_step_modules(self.base)  # whose one-token step a pass swaps
        self.scan_mixers = compat.scan_mixers(self.base)  # Mamba-1: scanned from the parent's state
        self.attn_implementation = compat.attention_implementation(self.base.config)
        # Multi-head latent attention: the split attention runs over its latent cache (attention.latent)
        self.mla_modules = compat.mla_modules(self.base)
        self._random: list[str] | None = None  # random_sources(), found once

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def name(self) -> str:
        return type(self.base).__name__

    @property
    def values_dtype(self) -> torch.dtype:
        """The dtype of the log-probs and entropies an executor returns: the head's for float32/float64,
        float32 for half types."""
        dt = self.head.weight.dtype
        return dt if dt in (torch.float32, torch.float64) else torch.float32

    @property
    def vocab_size(self) -> int:
        """Token ids must be below this: the rows of the input embedding and of the LM head."""
        rows = [self.head.weight.shape[0]]
        emb = self.base.get_input_embeddings() if hasattr(self.base, "get_input_embeddings") else None
        if emb is not None and getattr(emb, "weight", None) is not None:
            rows.append(emb.weight.shape[0])
        return min(rows)

    def make_cache(self, past: list[LayerPast], past_len: int, batch: int = 1, pieces: bool = False):
        """A fresh cache holding the ancestors' tensors (:func:`forkrl.core.executor.cache.build_cache`)."""
        return build_cache(self.base.config, self.layer_kinds, past, past_len, batch=batch, pieces=pieces)

    # ------------------------------------------------------------------ forward pieces
    def hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache=None,
        attention_mask: torch.Tensor | None = None,
        routers: list[torch.Tensor] | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **decoder_kwargs,
    ) -> torch.Tensor:
        """Final hidden states (after the last norm).

        Args:
            input_ids: ``[B, n]`` (None with ``inputs_embeds``).
            position_ids: ``[B, n]`` (``[3, B, n]`` for multimodal RoPE).
            cache: ancestors' keys/values, or None.
            attention_mask: optional 4D mask ``[1, 1, n, ctx + n]`` (packed mode).
            routers: a list that receives the MoE layers' router logits (``[B * n, E]`` each;
                ``output_router_logits=True``).
            inputs_embeds: ``[B, n, hidden]`` in place of ``input_ids`` (image rows spliced in,
                :mod:`forkrl.core.executor.vision`).
            **decoder_kwargs: further decoder arguments (Qwen3-VL's deepstack rows).

        Returns:
            ``[B, n, hidden]``.
        """
        kwargs = {self.cache_kwarg: cache, "use_cache": cache is not None, **decoder_kwargs}
        if routers is not None:
            kwargs["output_router_logits"] = True
        if self.takes_positions:  # else no positional encoding: the state carries the order
            kwargs["position_ids"] = position_ids
        with continuing(self.scan_mixers, cache):
            if inputs_embeds is not None:
                kwargs["inputs_embeds"] = inputs_embeds
            else:
                kwargs["input_ids"] = input_ids
            out = self.decoder(attention_mask=attention_mask, **kwargs)
        if cache is not None:
            check_pieces_used(cache, self.name)
        if routers is not None:
            routers.extend(getattr(out, "router_logits", None) or ())
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def logits(
        self, hidden: torch.Tensor, temperature: float, precision: HeadPrecision = "model"
    ) -> torch.Tensor:
        """LM head on ``[rows, hidden]`` -> float ``[rows, vocab]`` logits, scaled like the model and host.

        Args:
            precision: how the host computes its log-probs (:data:`HEAD_PRECISIONS`): ``"model"``,
                the head module as the model's forward runs it (under autocast: a half-precision
                GEMM, rounded gradients), scaled and softcapped in that dtype; ``"fp32_accumulate"``,
                TRL's fused LM head: logits from a GEMM in the compute dtype (autocast's, else the
                parameters'), everything after it in float32, and the logits' gradient rounded to the
                compute dtype but its products with the weight and the hidden states summed in float32;
                ``"fp32"``: the head in float32 outside autocast (TRL's ``cast_lm_head_to_fp32``).
        """
        if precision == "model":
            weight = getattr(self.head, "weight", None)
            if weight is not None and weight.is_floating_point() and hidden.dtype != weight.dtype:
                # Mamba's residual stays float32 under bf16 weights; its own head casts it so
                hidden = hidden.to(weight.dtype)
            logits = self.head(hidden)
        else:
            if precision == "fp32":
                dtype, hidden = torch.float32, hidden.float()
            else:
                dtype = compute_dtype(hidden.device, hidden.dtype)
            with torch.autocast(hidden.device.type, enabled=False):
                logits = _Fp32AccumulatedLinear.apply(hidden, self.head.weight, self.head.bias, dtype).float()
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
    def checkpointing_off(self) -> contextlib.AbstractContextManager[bool]:
        """Turn transformers' gradient checkpointing off for the duration (it drops the cache).

        Yields whether it was on. Replay mode is itself a checkpointing scheme.
        """
        return compat.checkpointing_off(self.model)

    @contextlib.contextmanager
    def attention_implementation(self, name: str | None) -> Iterator[None]:
        """Use attention implementation ``name`` for the duration (None: leave the model's).

        With forkrl's split attention, MLA modules also defer their key/value expansion to it
        (:func:`forkrl.core.attention.deferred_expand`), so it sees their latent cache pieces.
        """
        if name is None:
            yield
            return
        configs = list({id(c): c for c in (self.base.config, self.config)}.values())
        old = [compat.attention_implementation(c) for c in configs]
        for c in configs:
            compat.set_attention_implementation(c, name)
        mla = self.mla_modules if name == SPLIT_ATTENTION else []
        try:
            with compat.expand_kv_replaced(mla, deferred_expand):
                yield
        finally:
            for c, o in zip(configs, old, strict=True):
                compat.set_attention_implementation(c, o)

    def has_dropout(self) -> bool:
        """Whether a forward in the current mode draws random numbers (training with dropout > 0)."""
        return self.model.training and bool(self.random_sources())

    def random_sources(self) -> list[str]:
        """What makes a training-mode forward random, whatever the current mode, or [] when it is
        deterministic. Candidates are dropout modules with ``p > 0`` and the config's dropout rates
        and router jitter above 0; which of those a model reads differs by architecture (GPT-2's
        attention reads its module's rate, Llama's the config's), so where there are candidates a
        small batch is run twice in training mode with different seeds, once per adapter."""
        if self._random is None:
            found = self._random_candidates()
            self._random = found if found and self._forward_is_random() else []
        return self._random

    def _forward_is_random(self) -> bool:
        device = self.head.weight.device
        ids = torch.tensor([[1, 2, 3, 4, 5, 6]], device=device)
        training = {m: m.training for m in self.model.modules()}
        self.model.train()
        outs = []
        try:
            for seed in (0, 1):
                devices = [device] if device.type == "cuda" else []
                with (
                    torch.random.fork_rng(devices=devices),
                    torch.no_grad(),
                    torch.autocast(device.type, enabled=False),
                ):
                    torch.manual_seed(seed)
                    outs.append(self.model(input_ids=ids).logits)
        except Exception:  # noqa: BLE001 - a model that cannot run here (e.g. partitioned): assume its rates apply
            return True
        finally:
            for m, was in training.items():
                m.training = was
        return not torch.equal(outs[0], outs[1])

    def _random_candidates(self) -> list[str]:
        found = [
            f"{n}={getattr(self.config, n)}"
            for n in _RANDOM_CONFIG
            if float(getattr(self.config, n, 0.0) or 0.0) > 0
        ]
        rates = sorted({m.p for m in self.model.modules() if isinstance(m, nn.Dropout) and m.p > 0})
        if rates:
            found.append(f"nn.Dropout modules with p={', '.join(f'{p:g}' for p in rates)}")
        return found

    def check_deterministic(self) -> None:
        """Refuse a training-mode forward that draws random numbers (dropout, router jitter).

        A shared prefix runs once on a tree, so every sequence sharing it would get one dropout mask
        or noise draw where per-sequence training draws one for each: a different distribution of
        updates, not only another sample of the same one.

        Raises:
            UnsupportedModelError: naming the rates and the way out.
        """
        sources = self.random_sources()
        if sources:
            raise UnsupportedModelError(
                f"{self.name} draws random numbers in training mode ({'; '.join(sources)}): a tree computes a shared "
                "prefix once, so every sequence sharing it would get the same dropout mask where per-sequence "
                "training draws one each, a different distribution of updates; set the rates to 0 (TRL: "
                "disable_dropout=True zeroes the nn.Dropout modules; a config rate such as attention_dropout is set "
                "when loading, e.g. from_pretrained(..., attention_dropout=0.0)) or train without tree_packing"
            )


# Config fields whose value > 0 makes a training-mode forward random.
_RANDOM_CONFIG = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "resid_pdrop",
    "attn_pdrop",
    "embd_pdrop",
    "router_jitter_noise",
)


class _Fp32AccumulatedLinear(torch.autograd.Function):
    """``hidden @ weight.T + bias`` as TRL's fused LM head computes it: the product in ``dtype``
    (``[rows, vocab]`` logits, rounded to it); in backward the logits' gradient rounded to ``dtype``
    (TRL writes it into the logits tile), its products with the weight and the hidden states summed
    in float32 and returned in the inputs' dtypes (no rounding of the sums to ``dtype``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, dtype):  # noqa: D102
        h, w = hidden.to(dtype), weight.to(dtype)
        out = h @ w.t()
        if bias is not None:
            out = out + bias.to(dtype)
        ctx.save_for_backward(hidden, weight)
        ctx.dtype, ctx.has_bias = dtype, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        hidden, weight = ctx.saved_tensors
        grad_hidden = grad_weight = grad_bias = None
        # A backward called inside an autocast region would cast these products back to half precision.
        with torch.autocast(grad.device.type, enabled=False):
            g = grad.to(ctx.dtype)  # [rows, vocab]
            if ctx.needs_input_grad[0]:
                grad_hidden = _mm_float32(g, weight.to(ctx.dtype)).to(hidden.dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = _mm_float32(g.t(), hidden.to(ctx.dtype)).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_bias = g.float().sum(0).to(weight.dtype)
        return grad_hidden, grad_weight, grad_bias, None


def _mm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` summed and returned in float32: on CUDA from half inputs in one GEMM with a float32
    output (``out_dtype``, torch >= 2.8), elsewhere on float32 copies."""
    if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # an older torch: the float32 copies below
            pass
    return a.float() @ b.float()
