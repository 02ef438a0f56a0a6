"""Per-architecture tiny configs for scripts/model_sweep.py: plain data, one entry per model_type.

``OVERRIDES``: config fields set on top of the sweep's generic tiny sizes (``model_sweep.TINY``),
for architectures whose defaults those do not reach. A key naming a sub-config (``text_config``,
``vision_config``, ...) holds that sub-config's own fields; ``drop`` lists generic fields not to set;
``probe`` holds fields without which the default config does not build at all.

``AFTER_BUILD``: a method of the built model to call, with its arguments, before the sweep runs it.

``NEEDS``: architectures whose forward needs inputs a causal-LM run does not have (an encoder's
outputs, images or audio as required inputs, a separate decoder): reported as refused with the
reason, not run.
"""

from __future__ import annotations

_MAMBA = dict(mamba_d_state=4, mamba_d_conv=3, mamba_expand=2)

OVERRIDES: dict[str, dict] = {
    # Hybrids whose layer pattern or mixer sizes the generic fields do not reach (with two layers of
    # the default pattern they would hold no attention layer, or fail a size check).
    "bamba": dict(num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                  mamba_n_groups=2, mamba_chunk_size=4, **_MAMBA),
    "nemotron_h": dict(num_hidden_layers=3, hybrid_override_pattern="*MM", mamba_num_heads=4, mamba_head_dim=16,
                       n_groups=1, ssm_state_size=4, conv_kernel=3, expand=2, chunk_size=4),
    "granitemoehybrid": dict(num_hidden_layers=3, layer_types=["attention", "mamba", "mamba"], mamba_n_heads=4,
                             mamba_d_head=16, mamba_n_groups=1, mamba_chunk_size=4, **_MAMBA),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_dt_rank=4, use_mamba_kernels=False, **_MAMBA),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], mamba_headdim=16, n_mamba_heads=4, mamba_ngroups=1,
                   chunk_size=4, attention_head_dim=8, num_mem_blocks=1, **_MAMBA),
    "falcon_h1": dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_chunk_size=4, mamba_d_ssm=64,
                      **_MAMBA),
    # Fields the generic sizes miss, or that must agree with them.
    "codegen": dict(rotary_dim=4),  # rotary part of the 8-wide head (default 64)
    "kimi_linear": dict(linear_head_dim=8, linear_num_heads=4),  # 32 heads of 128 by default: ~55 s a run
    "gptj": dict(rotary_dim=4),  # as CodeGen
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # ^ its default rope_parameters is {}, but its rotary embedding looks them up per layer type
    # DBRX names its sizes n_heads/n_layers/max_seq_len; clip_qkv=None reaches torch.clamp(None, None).
    "dbrx": dict(n_heads=4, n_layers=2, max_seq_len=512,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2)),
    "dots1": dict(n_shared_experts=1),  # default None: the shared expert's width is a product with it
    "kolibri1_1": dict(head_dim=16, index_num_heads=2),  # default head sizes exceed the tiny hidden size
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),  # default pattern is None
    "zamba": dict(num_hidden_layers=3, layer_types=["linear_attention", "hybrid", "hybrid"], n_mamba_heads=2,
                  use_mamba_kernels=False, mamba_dt_rank=4, attention_head_dim=8, **_MAMBA),  # shared block twice
    "zaya": dict(num_experts_per_tok=1),  # ZAYA supports top-1 routing only
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=4),  # one global, one local layer
    "mamba2": dict(num_heads=8, head_dim=8, n_groups=1, state_size=4, chunk_size=4, expand=2),  # heads*dim = 2*32
    # Encoder-decoder families size their decoder with their own names (run as decoder-only LMs).
    "plbart": dict(encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
                   encoder_layers=2, decoder_layers=2),
    "prophetnet": dict(drop=["num_hidden_layers"], num_encoder_layers=2, num_decoder_layers=2,
                       num_encoder_attention_heads=4, num_decoder_attention_heads=4, encoder_ffn_dim=48,
                       decoder_ffn_dim=48),
    "xlnet": dict(drop=["max_position_embeddings"]),  # XLNet has no length limit: setting one raises
    # Reformer trains only in train mode (dropout off here) on lengths a multiple of its chunk (1 here);
    # LSH layers hash with fresh random rotations on every call, so two local-attention layers.
    "reformer": dict(is_decoder=True, attn_layers=["local", "local"], axial_pos_embds=False, axial_pos_shape=[16, 32],
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0,
                     local_attention_probs_dropout_prob=0.0,
                     axial_pos_embds_dim=[16, 16], attention_head_size=8, feed_forward_size=48,
                     lsh_attn_chunk_length=1, local_attn_chunk_length=1, num_buckets=4),
    "musicgen": dict(decoder=dict(num_codebooks=1)),  # one token stream (real checkpoints interleave 4)
    "musicgen_melody": dict(decoder=dict(num_codebooks=1)),  # as MusicGen
    # Per-layer tables keyed by layer index past the tiny depth (Gemma 4, dots3): dropped.
    "gemma4_text": dict(per_layer_config={}, vocab_size_per_layer_input=61, hidden_size_per_layer_input=8),
    "gemma4_unified_text": dict(per_layer_config={}, vocab_size_per_layer_input=61, hidden_size_per_layer_input=8),
    "gemma4": dict(text_config=dict(per_layer_config={}, vocab_size_per_layer_input=61,
                                    hidden_size_per_layer_input=8)),
    "gemma4_unified": dict(text_config=dict(per_layer_config={}, vocab_size_per_layer_input=61,
                                            hidden_size_per_layer_input=8)),
    "dots3_note_text": dict(per_layer_config={}, head_dim=8),  # sliding layers' head = MLA nope + rope
    "dots3_note": dict(text_config=dict(per_layer_config={}, head_dim=8)),
    # BLT: a 500k hash-embedding vocabulary and 2048-wide global patches by default.
    "blt": dict(encoder_hash_byte_group_vocab=64, encoder_config=dict(hidden_size_global=32),
                decoder_config=dict(hidden_size_global=32)),
    "whisper": dict(encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
                    encoder_layers=2, decoder_layers=2),  # as PLBart
    # QSA indexed-attention layers: the indexer's sizes have no defaults.
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                           indexer_compress_ratio=2),
    "qwen4_exp": dict(text_config=dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                                       indexer_compress_ratio=2)),
    # Gemma 3n: per-layer activation sparsity and KV sharing sized to the full depth.
    "gemma3n_text": dict(num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0], laurel_rank=4,
                         vocab_size_per_layer_input=61, hidden_size_per_layer_input=8),
    "gemma3n": dict(text_config=dict(num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0], laurel_rank=4,
                                     vocab_size_per_layer_input=61, hidden_size_per_layer_input=8)),
}  # fmt: skip

AFTER_BUILD: dict[str, tuple[str, tuple]] = {
    "xmod": ("set_default_language", ("en_XX",)),  # X-MOD routes every token through one language adapter
    "reformer": ("train", ()),  # its backward asserts train mode (dropout is off in its fields)
}

NEEDS: dict[str, str] = {
    # Gemma 4 multi-token-prediction drafters: forward raises without the target model's states.
    "gemma4_assistant": "needs the target model's inputs_embeds and shared_kv_states (a Gemma 4 draft model)",
    "gemma4_unified_assistant": "needs the target model's inputs_embeds and shared_kv_states (a Gemma 4 draft model)",
}
