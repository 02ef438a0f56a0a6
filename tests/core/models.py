"""Tiny transformers models built from configs (no downloads), for the core tests."""

from __future__ import annotations

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Lfm2Config,
    Lfm2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

VOCAB = 61


def make_model(name: str, dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0, **over):
    """A tiny causal LM by name: llama-mha, llama-gqa, llama-mqa, qwen2, qwen3, mistral-swa, gemma2, lfm2, qwen3next."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, max_position_embeddings=512)
    common.update(over)
    if name.startswith("llama"):
        kv = {"llama-mha": 4, "llama-gqa": 2, "llama-mqa": 1}[name]
        cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv, **common)
        cls = LlamaForCausalLM
    elif name == "qwen2":
        cfg = Qwen2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **common)
        cls = Qwen2ForCausalLM
    elif name == "qwen3":
        cfg = Qwen3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, **common)
        cls = Qwen3ForCausalLM
    elif name == "mistral-swa":
        cfg = MistralConfig(
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=6, **common
        )
        cls = MistralForCausalLM
    elif name == "gemma2":
        cfg = Gemma2Config(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=5,
            final_logit_softcapping=3.0,
            attn_logit_softcapping=None,
            **common,
        )
        cls = Gemma2ForCausalLM
        attn = "eager"  # Gemma2 has no sdpa path
    elif name == "lfm2":
        cfg = Lfm2Config(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            **common,
        )
        cls = Lfm2ForCausalLM
    elif name == "qwen3next":
        cfg = Qwen3NextConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            layer_types=["linear_attention", "full_attention"],
            **common,
        )
        cfg._experts_implementation = "eager"  # grouped_mm has no float64 kernel
        cls = Qwen3NextForCausalLM
    else:
        raise KeyError(name)
    cfg._attn_implementation = attn
    model = cls(cfg).to(dtype)
    model.eval()
    return model


def dense_logprobs(model, sequences, score_from, temperature: float = 1.0, entropy: bool = False):
    """Plain per-sequence forward: log-probs (and entropies) of the scored tokens, in the graph."""
    lps, ents = [], []
    for seq, sf in zip(sequences, score_from, strict=True):
        ids = torch.as_tensor(seq).reshape(1, -1)
        logits = model(input_ids=ids).logits[0] / temperature
        logp = torch.log_softmax(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), -1)
        lps.append(logp[sf - 1 : -1].gather(-1, ids[0, sf:, None])[:, 0])
        if entropy:
            ents.append(-(logp.exp() * logp).sum(-1)[sf - 1 : -1])
    return lps, (ents if entropy else None)


def grads(model):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def max_rel_err(got, want):
    """Largest relative error over a list of tensors, relative to the largest reference norm."""
    scale = max(float(w.norm()) for w in want) or 1.0
    return max(float((g - w).norm()) for g, w in zip(got, want, strict=True)) / scale
