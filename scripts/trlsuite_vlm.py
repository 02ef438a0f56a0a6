"""Vision-language assets for TRL's own VLM tests in the offline harness of ``../shared/trl_suite``.

A pytest plugin (``-p trlsuite_vlm``, loaded by ``scripts/trlsuite_vlm.sh``) beside the harness's
root conftest. It adds what that harness lacks for ``TestGRPOTrainerVLM`` / ``TestRLOOTrainerVLM``:

* **Datasets**: ``trl-internal-testing/zen-image`` and ``zen-multi-image`` from TRL's own
  ``scripts/generate_zen_image_dataset.py`` / ``generate_zen_multi_image_dataset.py`` (taken from
  ``$TRL_GIT``; their ``push_to_hub`` saved to the harness's dataset folder, which its
  ``load_dataset`` serves).
* **Models**: tiny ``trl-internal-testing/tiny-*ForConditionalGeneration`` repos with the sizes of
  TRL's ``scripts/generate_tiny_models/for_conditional_generation`` (bf16 weights), each with its
  family's processor built offline over the harness's byte-level tokenizer (the family's special
  tokens added) and a small chat template that writes the family's image placeholder. Families
  whose processor cannot be built here (Gemma 4: audio and video parts) are not built, so their
  tests fail in every mode alike.
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

ORG = "trl-internal-testing"
TEMPLATE = (
    "{%- for message in messages %}{{ '<|turn|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}"
    "{%- for c in message['content'] %}{%- if c['type'] == 'image' %}IMAGE{%- elif c['type'] == 'text' %}"
    "{{ c['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{ '<|end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|turn|>assistant\n' }}{%- endif %}"
)
_QWEN_VL = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
TEXT = dict(
    num_hidden_layers=2, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32
)


def _harness():
    """The harness's root conftest (its tokenizer, cache layout and dataset folder)."""
    module = sys.modules.get("conftest")
    if module is None or not hasattr(module, "make_tokenizer"):
        import importlib.util

        spec = importlib.util.spec_from_file_location("trlsuite_root", Path.cwd() / "conftest.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def _tokenizer(h, placeholder_tokens: list[str], extra: dict | None = None):
    """The harness's byte-level tokenizer (Qwen family specials) plus the turn markers and the model's
    image tokens; ``extra`` names tokens the processor reads as tokenizer attributes."""
    tok = h.make_tokenizer("qwen2_5")
    tok.add_special_tokens({"additional_special_tokens": ["<|turn|>", "<|end|>", *placeholder_tokens]})
    tok.eos_token = "<|end|>"
    if extra:  # named special tokens (e.g. Gemma 3's boi_token), as a saved tokenizer config declares them
        import tempfile

        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory() as tmp:
            tok.save_pretrained(tmp)
            tok = AutoTokenizer.from_pretrained(tmp, extra_special_tokens=extra)
    return tok


def _template(image: str) -> str:
    return TEMPLATE.replace("IMAGE", image)


def _without_video() -> None:
    """Processors built, saved and loaded without their video processor when torchvision (which
    transformers' video processors need) is not installed: TRL's VLM tests pass images only. Stock
    and forkrl runs alike."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.processing_utils import ProcessorMixin

    attributes = ProcessorMixin.get_attributes.__func__
    ProcessorMixin.get_attributes = classmethod(
        lambda cls: [a for a in attributes(cls) if a != "video_processor"]
    )


def _qwen_vl(
    h, cls_name: str, proc_name: str, vision: dict, text_extra: dict | None = None, patch: int = 14, **cfg
):
    import transformers

    tok = _tokenizer(h, [])
    ids = tok.convert_tokens_to_ids(_QWEN_VL)
    side = 2 * patch  # one merged 2x2 block of patches at least, four at most
    image = transformers.Qwen2VLImageProcessor(
        patch_size=patch, min_pixels=side * side, max_pixels=4 * side * side
    )
    proc = getattr(transformers, proc_name)(
        image_processor=image,
        tokenizer=tok,
        chat_template=_template("<|vision_start|><|image_pad|><|vision_end|>"),
    )
    model_cls = getattr(transformers, cls_name)
    text = dict(TEXT, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                **(text_extra or {}))  # fmt: skip
    config = model_cls.config_class(
        text_config=text, vision_config=vision, vision_start_token_id=ids[0], image_token_id=ids[1],
        vision_end_token_id=ids[2], video_token_id=ids[3], **cfg,
    )  # fmt: skip
    return config, model_cls, proc, tok


def _qwen2_vl(h):
    mrope = {"rope_type": "default", "mrope_section": [1, 1], "rope_theta": 1000000.0}
    return _qwen_vl(h, "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor",
                    dict(hidden_size=16, num_heads=4, embed_dim=64, depth=2), dict(rope_parameters=mrope))  # fmt: skip


def _qwen2_5_vl(h):
    mrope = {"rope_type": "default", "mrope_section": [1, 1], "rope_theta": 1000000.0}
    return _qwen_vl(h, "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor",
                    dict(hidden_size=16, num_heads=4, depth=2, fullatt_block_indexes=[1], out_hidden_size=16),
                    dict(rope_parameters=mrope))  # fmt: skip


def _qwen3_5(h, moe: bool = False):
    text = dict(layer_types=["linear_attention", "full_attention"], head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)  # fmt: skip
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32)  # fmt: skip
    vision = dict(hidden_size=16, num_heads=4, depth=2, intermediate_size=32, out_hidden_size=16,
                  num_position_embeddings=64)  # fmt: skip
    name = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    return _qwen_vl(h, name, "Qwen3VLProcessor", dict(vision, patch_size=16), text, patch=16)


def _llava_next(h):
    import transformers

    tok = _tokenizer(h, ["<image>"])
    image = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8},
        image_grid_pinpoints=[[8, 8], [8, 16], [16, 8], [16, 16]],
    )  # fmt: skip
    proc = transformers.LlavaNextProcessor(
        image_processor=image, tokenizer=tok, patch_size=2, vision_feature_select_strategy="default",
        chat_template=_template("<image>"), image_token="<image>", num_additional_image_tokens=1,
    )  # fmt: skip
    config = transformers.LlavaNextConfig(
        text_config=dict(TEXT, model_type="mistral", vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id),
        vision_config=dict(model_type="clip_vision_model", num_hidden_layers=2, hidden_size=16, num_attention_heads=4,
                           intermediate_size=32, image_size=8, patch_size=2),
        image_token_index=tok.convert_tokens_to_ids("<image>"), image_grid_pinpoints=image.image_grid_pinpoints,
    )  # fmt: skip
    return config, transformers.LlavaNextForConditionalGeneration, proc, tok


def _gemma3(h):
    import transformers

    special = {
        "boi_token": "<start_of_image>",
        "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>",
    }
    tok = _tokenizer(h, list(special.values()), special)
    image = transformers.Gemma3ImageProcessor(size={"height": 224, "width": 224})
    proc = transformers.Gemma3Processor(
        image_processor=image,
        tokenizer=tok,
        chat_template=_template("<start_of_image>"),
        image_seq_length=256,
    )
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in special.items()}
    config = transformers.Gemma3Config(
        text_config=dict(TEXT, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         layer_types=None),
        vision_config=dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=4, intermediate_size=32,
                           image_size=224, patch_size=14, vision_use_head=False),
        image_token_index=ids["image_token"], boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
        mm_tokens_per_image=256,
    )  # fmt: skip
    return config, transformers.Gemma3ForConditionalGeneration, proc, tok


MODELS = {
    "tiny-Qwen2VLForConditionalGeneration": _qwen2_vl,
    "tiny-Qwen2_5_VLForConditionalGeneration": _qwen2_5_vl,
    "tiny-Qwen3_5ForConditionalGeneration-NoThink": _qwen3_5,
    "tiny-Qwen3_5MoeForConditionalGeneration-3.6": lambda h: _qwen3_5(h, moe=True),
    "tiny-LlavaNextForConditionalGeneration": _llava_next,
    "tiny-Gemma3ForConditionalGeneration": _gemma3,
}


def build_model(h, name: str) -> None:
    import torch
    from transformers import GenerationConfig

    snap = h._snapshot(f"{ORG}/{name}", h.HUB)
    if (snap / ".complete").exists():
        return
    config, model_cls, proc, tok = MODELS[name](h)
    torch.manual_seed(0)
    model = model_cls(config).to(dtype=torch.bfloat16)
    h._init_weights_tiny_model(model)
    tmp = snap.with_name(snap.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    proc.save_pretrained(tmp)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(tmp)
    (tmp / ".complete").write_text("ok")
    shutil.rmtree(snap, ignore_errors=True)
    tmp.rename(snap)


def build_datasets(h) -> None:
    from datasets import Dataset, DatasetDict

    for script, repo in (("generate_zen_image_dataset.py", "zen-image"),
                         ("generate_zen_multi_image_dataset.py", "zen-multi-image")):  # fmt: skip
        marker = h.DATA / ORG / repo / ".complete"
        if marker.exists():
            continue
        path = Path("scripts") / script
        if not path.exists():
            rev = os.environ.get("TRL_REV") or "HEAD"
            text = subprocess.run(["git", "-C", os.environ["TRL_GIT"], "show", f"{rev}:scripts/{script}"],
                                  check=True, capture_output=True, text=True).stdout  # fmt: skip
            path.write_text(text)
        saved = DatasetDict.push_to_hub, Dataset.push_to_hub

        def to_disk(self, repo_id, config_name="default", **_):
            self.save_to_disk(str(h.DATA / repo_id / config_name))

        DatasetDict.push_to_hub = Dataset.push_to_hub = to_disk
        try:
            import numpy as np

            np.random.seed(0)
            runpy.run_path(str(path))["main"](test_size=0.1, push_to_hub=True, repo_id=f"{ORG}/{repo}")
        finally:
            DatasetDict.push_to_hub, Dataset.push_to_hub = saved
        marker.write_text("ok")


def pytest_configure(config):
    _without_video()
    h = _harness()
    build_datasets(h)
    for name in MODELS:
        build_model(h, name)
