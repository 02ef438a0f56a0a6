"""Tiny Qwen-VL models and their processors, built offline, for the hosts' vision-language tests.

The processor is the family's own over the byte tokenizer (:func:`.models.byte_tokenizer`) with the
Qwen-VL image tokens added, its image processor's PIL backend and no video processor (transformers'
video processors need torchvision, which the test environments leave out). A ``side`` x ``side``
image makes a ``(side / patch)^2`` patch grid and a quarter as many placeholder tokens.
"""

from __future__ import annotations

import torch

__all__ = ["SPECIAL", "TEMPLATE", "qwen_vl_model", "qwen_vl_processor"]

#: The Qwen-VL family's image and video tokens: vision start, image placeholder, vision end, video placeholder.
SPECIAL = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]

#: A chat template writing each image as ``<|vision_start|><|image_pad|><|vision_end|>`` (the
#: processor expands the placeholder to the image's rows).
TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)

_PROCESSORS = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_5_moe": "Qwen3VLProcessor",
}


def qwen_vl_processor(
    family: str = "qwen2_vl", side: int = 56, patch: int = 14, chat_template: str | None = TEMPLATE
):
    """The family's processor (``qwen2_vl``, ``qwen2_5_vl``; ``qwen3_5_moe``: Qwen3-VL's) over the
    byte tokenizer; every image is resized to ``side`` x ``side`` pixels."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    from .models import byte_tokenizer

    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: (
        None if arg is None else check(self, name, arg)
    )
    try:
        image = transformers.Qwen2VLImageProcessor(
            patch_size=patch, min_pixels=side * side, max_pixels=side * side
        )
        cls = getattr(transformers, _PROCESSORS[family])
        return cls(image_processor=image, tokenizer=tok, video_processor=None, chat_template=chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def qwen_vl_model(tok, family: str = "qwen2_vl", **config) -> torch.nn.Module:
    """A tiny float32 Qwen2-VL or Qwen2.5-VL (2 decoder layers of width 32, M-RoPE; a 2-layer
    vision tower, patch 14, 2x2 merge; Qwen2.5-VL: window attention in the tower, one full layer),
    seed 0; ``config`` overrides the top-level config's arguments."""
    import transformers

    ids = tok.convert_tokens_to_ids(SPECIAL)
    vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    if family == "qwen2_5_vl":  # a window of 2x2 merged patches, one full layer
        vision.update(intermediate_size=64, out_hidden_size=32, fullatt_block_indexes=[1], window_size=56)
    config_cls, model_cls = {
        "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
    }[family]
    cfg = config_cls(
        text_config=dict(
            vocab_size=len(tok) + 2, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        ),
        vision_config=vision, vision_start_token_id=ids[0], image_token_id=ids[1], vision_end_token_id=ids[2],
        video_token_id=ids[3], **config,
    )  # fmt: skip
    torch.manual_seed(0)
    return model_cls(cfg).float()
