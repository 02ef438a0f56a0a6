"""Tiny models and tokenizers built from configs (no downloads), shared by tests, benchmarks, examples.

- :func:`tiny_causal_lm`: the test zoo, one tiny model per architecture forkrl supports
  (:data:`ZOO`): MHA/GQA/MQA Llama, Qwen2, Qwen3 (q/k norms), Mistral with a sliding window,
  Gemma 2 (logit softcapping, eager), LFM2 (conv + attention), Qwen3-Next (linear attention + MoE),
  Qwen3-MoE, Mixtral, OLMoE, GPT-OSS (MoE with the router load-balancing loss), Bamba and
  NemotronH (Mamba-2 + attention layers), Falcon-H1 (both in one layer), Mamba-2, Mamba,
  FalconMamba, Jamba (+ attention and MoE) and Zamba (Mamba-1 selective scans), DeepSeek-V2, DeepSeek-V3 and a
  Kimi-K2-shaped DeepSeek-V3 (multi-head latent attention + MoE).
- :func:`llama`: the benchmark sizes (:data:`SIZES`: "tiny", "small", and "micro" for smoke runs).
- :func:`byte_tokenizer`, :func:`word_tokenizer`, :func:`byte_llama`, :func:`save_pretrained`:
  what a host trainer needs to load a model by path (TRL's ``GRPOTrainer(model=path)``).
- :func:`dense_logprobs`, :func:`grads`, :func:`max_rel_err`: the plain computation exactness
  tests compare against.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import compat

__all__ = [
    "BYTE_EOS",
    "BYTE_PAD",
    "BYTE_VOCAB",
    "SIZES",
    "TEST_VOCAB",
    "ZOO",
    "BYTE_MOE",
    "byte_llama",
    "byte_model",
    "byte_moe",
    "byte_tokenizer",
    "dense_logprobs",
    "flops_per_token",
    "grads",
    "grpo_rollouts",
    "llama",
    "max_rel_err",
    "save_pretrained",
    "tiny_causal_lm",
    "word_tokenizer",
]

TEST_VOCAB = 61
_ATTN = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# MLA: every query head has its own expanded key/value head; query-key heads nope + rope = 8 wide,
# value heads 6; layer 0 dense, layer 1 MoE
_MLA = dict(
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=8,
    q_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=6,
    moe_intermediate_size=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
)

# name -> (transformers config and model class names, config fields beyond the common tiny ones)
ZOO: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-mha": ("LlamaConfig", "LlamaForCausalLM", {**_ATTN, "num_key_value_heads": 4}),
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", _ATTN),
    "llama-mqa": ("LlamaConfig", "LlamaForCausalLM", {**_ATTN, "num_key_value_heads": 1}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _ATTN),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_ATTN, "head_dim": 8}),
    "mistral-swa": ("MistralConfig", "MistralForCausalLM", {**_ATTN, "sliding_window": 6}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            **_ATTN,
            "head_dim": 8,
            "sliding_window": 5,
            "final_logit_softcapping": 3.0,
            "attn_logit_softcapping": None,
        },
    ),
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        {
            **_ATTN,
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        },
    ),
    "qwen3next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            **_ATTN,
            "head_dim": 8,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "layer_types": ["linear_attention", "full_attention"],
        },
    ),
    # MoE with transformers' router load-balancing loss (output_router_logits)
    "qwen3moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**_ATTN, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_ATTN, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {**_ATTN, "num_experts": 4, "num_experts_per_tok": 2}),
    "gptoss": (  # attention sinks (eager only), sliding-window layers
        "GptOssConfig",
        "GptOssForCausalLM",
        {**_ATTN, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # Mamba-2 + attention hybrids (conv and SSM states carried per node)
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        {
            **_ATTN,
            "num_hidden_layers": 3,
            "attn_layer_indices": [1],
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_n_groups": 2,
            "mamba_d_state": 4,
            "mamba_d_conv": 3,
            "mamba_expand": 2,
            "mamba_chunk_size": 4,
        },
    ),
    "nemotronh": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        {
            **_ATTN,
            "num_hidden_layers": 3,
            "hybrid_override_pattern": "*MM",  # M*M: its own decode differs from its forward (4e-11)
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 1,
            "ssm_state_size": 4,
            "conv_kernel": 3,
            "expand": 2,
            "chunk_size": 4,
            "head_dim": 8,
        },
    ),
    "falconh1": (  # attention and Mamba-2 side by side in every layer (one mixed cache layer)
        "FalconH1Config",
        "FalconH1ForCausalLM",
        {
            **_ATTN,
            "head_dim": 8,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_n_groups": 1,
            "mamba_d_ssm": 64,
            "mamba_d_state": 4,
            "mamba_d_conv": 3,
            "mamba_expand": 2,
            "mamba_chunk_size": 4,
        },
    ),
    # Mamba-1 (selective scan): pure SSMs without position ids, Jamba's Mamba + attention (+ MoE),
    # Zamba. Larger initial weights for the hybrids: at the default 0.02 their SSM state moves the
    # log-probs by 1e-7 (Jamba) and 1e-13 (Zamba), too little for a test to see a state dropped
    "mamba": ("MambaConfig", "MambaForCausalLM", {"num_hidden_layers": 2, "state_size": 4, "conv_kernel": 3}),
    "mamba2": (  # the pure Mamba-2 SSM (its forward takes no position ids either)
        "Mamba2Config",
        "Mamba2ForCausalLM",
        {
            "num_hidden_layers": 2,
            "num_heads": 8,
            "head_dim": 8,
            "n_groups": 1,
            "state_size": 4,
            "chunk_size": 4,
        },
    ),
    "falconmamba": (  # RMS norms on dt, B, C
        "FalconMambaConfig",
        "FalconMambaForCausalLM",
        {"num_hidden_layers": 2, "state_size": 4, "conv_kernel": 3},
    ),
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        {
            **_ATTN,
            "num_hidden_layers": 3,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "mamba_d_state": 4,
            "mamba_d_conv": 3,
            "mamba_expand": 2,
            "mamba_dt_rank": 4,
            "initializer_range": 0.1,
        },
    ),
    "zamba": (  # Mamba-1 split into heads; one attention block shared by the two hybrid layers
        "ZambaConfig",
        "ZambaForCausalLM",
        {
            **_ATTN,
            "num_hidden_layers": 3,
            "layers_block_type": ["mamba", "hybrid", "hybrid"],
            "attention_head_dim": 8,
            "n_mamba_heads": 2,
            "mamba_d_state": 4,
            "mamba_d_conv": 3,
            "mamba_expand": 2,
            "mamba_dt_rank": 4,
            "initializer_range": 0.2,
        },
    ),
    # Multi-head latent attention (latent cache, value heads narrower than query-key heads) + MoE
    "deepseekv2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {**_MLA, "q_lora_rank": None}),
    "deepseekv3": (  # group-limited routing (n_group/topk_group), q LoRA, interleaved rope
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {**_MLA, "head_dim": 4, "n_routed_experts": 8, "n_group": 4, "topk_group": 2},
    ),
    "kimik2": (  # Kimi K2 / Moonlight: DeepSeek-V3's architecture, many experts in one group, rope not interleaved
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **_MLA,
            "num_hidden_layers": 3,
            "head_dim": 4,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 1,
            "topk_group": 1,
            "kv_lora_rank": 12,
            "q_lora_rank": 6,
            "rope_interleave": False,
        },
    ),
}
_MOE = ("qwen3next", "qwen3moe", "mixtral", "olmoe", "gptoss", "jamba", "deepseekv2", "deepseekv3", "kimik2")


def tiny_causal_lm(
    name: str = "llama-gqa",
    dtype: torch.dtype = torch.float64,
    attn: str = "sdpa",
    seed: int = 0,
    **config: Any,
) -> nn.Module:
    """A tiny causal LM of architecture ``name`` (a key of :data:`ZOO`), in eval mode.

    Hidden size 32, vocabulary :data:`TEST_VOCAB`; ``config`` overrides any config field. Gemma 2,
    GPT-OSS and the attention-free Mamba, Mamba-2 and FalconMamba always use eager attention (no sdpa path);
    MoE experts run eagerly (grouped_mm has no float64 kernel).
    """
    import transformers

    if name not in ZOO:
        raise KeyError(f"unknown tiny model {name!r}: choose one of {sorted(ZOO)}")
    config_cls, model_cls, fields = ZOO[name]
    common = dict(vocab_size=TEST_VOCAB, hidden_size=32, intermediate_size=48, max_position_embeddings=512)
    cfg = getattr(transformers, config_cls)(**{**common, **fields, **config})
    if name in ("gemma2", "gptoss", "mamba", "mamba2", "falconmamba"):  # no sdpa path (or no attention)
        attn = "eager"
    if name in _MOE:
        compat.set_experts_implementation(cfg, "eager")
    compat.set_attention_implementation(cfg, attn)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).to(dtype)
    model.eval()
    return model


# name: (hidden, layers, heads, kv_heads, intermediate, vocab)
SIZES = {
    "tiny": (128, 4, 4, 4, 344, 32000),
    "small": (512, 8, 8, 8, 1376, 32000),
    "mini": (256, 4, 4, 4, 688, 32000),  # the per-leaf-overhead shape of the sibling-batching target
    "micro": (64, 2, 4, 2, 172, 1024),  # smoke tests only
}


def llama(
    size: str,
    dtype: torch.dtype = torch.float32,
    attn: str = "sdpa",
    max_pos: int = 1 << 18,
    **overrides: Any,
) -> nn.Module:
    """A randomly initialised Llama of one of the :data:`SIZES` (seed 0); ``overrides`` are config fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, inter, vocab = SIZES[size]
    fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_pos,
    )
    cfg = LlamaConfig(**{**fields, **overrides})
    compat.set_attention_implementation(cfg, attn)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype)


def flops_per_token(size: str, vocab: int | None = None) -> tuple[float, float, float]:
    """Forward FLOPs of a :data:`SIZES` Llama (with ``vocab`` instead of its own, if given): (per
    token in linear layers, per token per context position in attention, LM head per row)."""
    hidden, layers, heads, kv, inter, own_vocab = SIZES[size]
    vocab = vocab or own_vocab
    head_dim = hidden // heads
    linear = 2 * layers * (hidden * hidden * 2 + 2 * hidden * kv * head_dim + 3 * hidden * inter)
    attn = layers * 4 * heads * head_dim  # QK^T and AV, per query per key
    return float(linear), float(attn), float(2 * hidden * vocab)


# ---------------------------------------------------------------------------- tokenizers and saved models

BYTE_PAD, BYTE_EOS, BYTE_VOCAB = 256, 257, 260


def byte_tokenizer():
    """Byte-level tokenizer (no merges) with <pad> = 256 and <eos> = 257: nothing to download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    alphabet, extra = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[chr(b)] = b
        else:
            alphabet[chr(256 + extra)] = b
            extra += 1
    vocab = {**alphabet, "<pad>": BYTE_PAD, "<eos>": BYTE_EOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def word_tokenizer(vocab: int):
    """A word-level tokenizer over ids ``t0..t{vocab-3}`` plus <pad> (``vocab - 2``) and <eos> (``vocab - 1``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {f"t{i}": i for i in range(vocab - 2)}
    table["<pad>"], table["<eos>"] = vocab - 2, vocab - 1
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def byte_llama(seed: int = 0, **config: Any) -> nn.Module:
    """A tiny GQA Llama for :func:`byte_tokenizer` (vocab 260, <pad> 256, <eos> 257), float32.

    Hidden 32, 2 layers unless ``config`` says otherwise; the generation config carries pad/eos.
    """
    return _byte_model("LlamaConfig", "LlamaForCausalLM", seed, {"intermediate_size": 64, **config})


def byte_model(name: str, seed: int = 0, **config: Any) -> nn.Module:
    """The :data:`ZOO` architecture ``name`` for :func:`byte_tokenizer` (as :func:`byte_llama`; the
    MoE entries of :data:`BYTE_MOE` with their experts), float32, loadable by a host from a path."""
    if name in BYTE_MOE:
        return byte_moe(name, seed, **config)
    config_cls, model_cls, fields = ZOO[name]
    fields = {k: v for k, v in fields.items() if _ATTN.get(k, object()) != v}  # the byte model's head counts
    return _byte_model(config_cls, model_cls, seed, {**fields, **config})


def _byte_model(config_cls: str, model_cls: str, seed: int, config: dict[str, Any]) -> nn.Module:
    """A tiny float32 causal LM for :func:`byte_tokenizer` (hidden 32, 2 layers, GQA 4/2); the
    generation config carries pad/eos; ``config`` overrides fields."""
    import transformers

    fields = dict(
        vocab_size=BYTE_VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=BYTE_PAD,
        eos_token_id=BYTE_EOS,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(
        getattr(transformers, config_cls)(**{**fields, **config})
    ).float()
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    return model


# name -> (config class, model class, expert fields): MoE models with the router load-balancing loss
BYTE_MOE = {
    "qwen3moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, head_dim=8, moe_intermediate_size=16),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "gptoss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, head_dim=8)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4)),
}


def byte_moe(name: str = "qwen3moe", seed: int = 0, **config: Any) -> nn.Module:
    """A tiny MoE causal LM (:data:`BYTE_MOE`: 4 experts, top-2, 2 layers, hidden 32) for
    :func:`byte_tokenizer`, float32; ``config`` overrides fields (``router_aux_loss_coef``, ...)."""
    config_cls, model_cls, experts = BYTE_MOE[name]
    return _byte_model(config_cls, model_cls, seed, {"num_experts_per_tok": 2, **experts, **config})


def save_pretrained(model: nn.Module, tokenizer, path: str | Path) -> str:
    """Save a model and its tokenizer where a host can load them by path; returns the path."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------------------- the plain computation


def dense_logprobs(model, sequences, score_from, temperature: float = 1.0, entropy: bool = False):
    """Plain per-sequence forward: log-probs (and entropies) of the scored tokens, in the graph.

    Returns:
        ``(logprobs, entropies or None)``: one ``[len_i - score_from_i]`` tensor per sequence.
    """
    lps, ents = [], []
    device = next(model.parameters()).device
    for seq, sf in zip(sequences, score_from, strict=True):
        ids = torch.as_tensor(seq).reshape(1, -1).to(device)
        logits = model(input_ids=ids, use_cache=False).logits[0] / temperature
        logp = torch.log_softmax(
            logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), -1
        )
        lps.append(logp[sf - 1 : -1].gather(-1, ids[0, sf:, None])[:, 0])
        if entropy:
            ents.append(-(logp.exp() * logp).sum(-1)[sf - 1 : -1])
    return lps, (ents if entropy else None)


def grpo_rollouts(
    seed: int = 0, groups: int = 2, n: int = 4, prompt: int = 12, response: int = 7, vocab: int = 250
) -> list[tuple[list[int], list[int]]]:
    """GRPO-shaped ``(prompt, response)`` token lists for host tests: ``groups`` prompts (sharing a
    system opening) with ``n`` responses each, of varying lengths; some responses extend others, one
    repeats."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda k: torch.randint(0, vocab, (k,), generator=g).tolist()  # noqa: E731
    system = rand(prompt // 2)
    out = []
    for q in range(groups):
        p = system + rand(prompt - len(system) - q)
        first = rand(response)
        for k in range(n):
            r = first[: 1 + (k * 3) % response] if k % 2 else rand(1 + (k * 5) % response)
            out.append((p, r))
    out[-1] = out[-2]
    return out


def left_padded(rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt, completion)`` token lists as the hosts batch them: prompts left-padded to the
    longest ``P``, completions right-padded to the longest ``C``.

    Returns:
        ``ids`` ``[B, P + C]`` (0 at padding) and its attention ``mask`` ``[B, P + C]`` (0/1, long).
    """
    P, C = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids = torch.zeros(len(rows), P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, c) in enumerate(rows):
        ids[b, P - len(p) : P], mask[b, P - len(p) : P] = torch.tensor(list(p), dtype=torch.long), 1
        ids[b, P : P + len(c)], mask[b, P : P + len(c)] = torch.tensor(list(c), dtype=torch.long), 1
    return ids, mask


def grads(model: nn.Module) -> list[torch.Tensor]:
    """A copy of every parameter's gradient (zeros where there is none)."""
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]


def max_rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest error over a list of tensors, relative to the largest reference norm."""
    scale = max(float(w.norm()) for w in want) or 1.0
    return max(float((g - w).norm()) for g, w in zip(got, want, strict=True)) / scale
