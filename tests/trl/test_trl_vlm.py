"""TRL's GRPOTrainer and RLOOTrainer on a vision-language model (a tiny Qwen2-VL and its processor, images in the
dataset) with ``tree_packing=True``: TRL builds the batches (its processor, its seeded generation,
its pixel values per row) and forkrl's trainer equals stock's parameters after its steps; each
group's image runs through the vision tower once per tree pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forkrl.core.testing.stock import relative_difference
from forkrl.core.testing.vision import SPECIAL, TEMPLATE, qwen_vl_model, qwen_vl_processor

from .trl_helpers import base_args


def _reward(completions, completion_ids, **kwargs) -> list[float]:
    """Varies within every group (the tiny model's completions rarely hold the letters of TRL's
    usual test reward): the mean of the completion's token ids modulo 7, scaled."""
    return [sum(t % 7 for t in ids) / (7 * max(1, len(ids))) for ids in completion_ids]


def _processor(qwen3_5: bool = False):
    """Qwen2-VL's processor (Qwen3.5's: Qwen3-VL's, patch 16, 64x64 images) over the byte tokenizer."""
    return qwen_vl_processor("qwen3_5_moe", side=64, patch=16) if qwen3_5 else qwen_vl_processor()


def _llava_processor():
    """LLaVA's processor over the byte tokenizer (CLIP's image processor, PIL backend): an 8x8 image
    makes 16 ``<image>`` tokens (patch 2, CLS dropped)."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    from forkrl.core.testing.models import byte_tokenizer

    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image = CLIPImageProcessor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    template = TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
    return LlavaProcessor(
        image_processor=image, tokenizer=tok, patch_size=2, vision_feature_select_strategy="default",
        chat_template=template, image_token="<image>", num_additional_image_tokens=1,
    )  # fmt: skip


def _qwen3_5_moe(tok):
    """A tiny Qwen3.5-MoE VLM: a linear-attention and a full-attention layer, 4 experts (top 2)."""
    import transformers

    ids = tok.convert_tokens_to_ids(SPECIAL)
    config = transformers.Qwen3_5MoeConfig(
        text_config=dict(
            vocab_size=len(tok) + 2, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        ),
        vision_config=dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=64, out_hidden_size=32,
                           num_position_embeddings=16, patch_size=16, spatial_merge_size=2, temporal_patch_size=2),
        vision_start_token_id=ids[0], image_token_id=ids[1], vision_end_token_id=ids[2], video_token_id=ids[3],
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3_5MoeForConditionalGeneration(config)


def _gemma3_processor():
    """Gemma 3's processor over the byte tokenizer: an 8x8 image makes 4 image tokens (SigLIP patch
    2, pooled 2x2) between its begin and end tokens; the tokenizer names them as Gemma's does."""
    import tempfile

    from transformers import AutoTokenizer, Gemma3ImageProcessor, Gemma3Processor

    from forkrl.core.testing.models import byte_tokenizer

    named = {
        "boi_token": "<start_of_image>",
        "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>",
    }
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(named.values())})
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        tok = AutoTokenizer.from_pretrained(tmp, extra_special_tokens=named)
    template = TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<start_of_image>")
    image = Gemma3ImageProcessor(size={"height": 8, "width": 8})
    return Gemma3Processor(image_processor=image, tokenizer=tok, chat_template=template, image_seq_length=4)


def _gemma3(tok):
    import transformers

    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=len(tok) + 2, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"], pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=None),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=8, patch_size=2, vision_use_head=False),
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"), mm_tokens_per_image=4,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(config)


def _llava(tok):
    import transformers

    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=8, patch_size=2,
        ),
        text_config=transformers.LlamaConfig(
            vocab_size=len(tok) + 2, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id, bos_token_id=None,
        ),
        image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(config)


def _model(tok):
    return qwen_vl_model(tok)


def _dataset(n: int = 4, size: int = 56):
    from datasets import Dataset
    from PIL import Image

    rng = np.random.RandomState(0)
    images = [Image.fromarray((rng.rand(size, size, 3) * 255).astype("uint8")) for _ in range(n)]
    prompts = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Spell color {i}."}]}]
        for i in range(n)
    ]
    return Dataset.from_dict({"prompt": prompts, "image": images})


def _train(tmp_path, forkrl: bool, kind: str = "grpo", **kw):
    import trl

    from forkrl.plugins import trl as ftrl

    family = kind.split("-")[1] if "-" in kind else "qwen2_vl"
    processors = {
        "llava": _llava_processor,
        "gemma3": _gemma3_processor,
        "qwen3_5moe": lambda: _processor(True),
    }
    processor = processors.get(family, _processor)()
    model = tmp_path / family  # a path, as users pass it (TRL loads the reference from it)
    if not model.exists():
        builders = {"llava": _llava, "gemma3": _gemma3, "qwen3_5moe": _qwen3_5_moe}
        builders.get(family, _model)(processor.tokenizer).save_pretrained(model)
    args = base_args(tmp_path / ("tree" if forkrl else "stock"), max_steps=2, max_completion_length=8, **kw)
    config, trainer_cls = ("RLOOConfig", "RLOOTrainer") if kind == "rloo" else ("GRPOConfig", "GRPOTrainer")
    if forkrl:
        args, cls = getattr(ftrl, config)(**args, tree_packing=True), getattr(ftrl, trainer_cls)
    else:
        args, cls = getattr(trl, config)(**args), getattr(trl, trainer_cls)
    trainer = cls(
        model=str(model),
        reward_funcs=_reward,
        args=args,
        train_dataset=_dataset(size={"qwen2_vl": 56, "qwen3_5moe": 64}.get(family, 8)),
        processing_class=processor,
    )
    init = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return init, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("grpo", {}),
        ("grpo", {"beta": 0.04, "num_iterations": 2}),
        ("rloo", {}),
        ("grpo-llava", {}),
        ("grpo-gemma3", {"beta": 0.04}),
        ("grpo-qwen3_5moe", {"router_aux_loss_coef": 0.5}),
    ],
    ids=["grpo", "grpo-kl-two-iterations", "rloo", "grpo-llava", "grpo-gemma3-kl", "grpo-qwen3_5moe-router"],
)
def test_a_vision_language_model_equals_stock(tmp_path, kind, extra):
    init, stock, _ = _train(tmp_path, forkrl=False, kind=kind, **extra)
    _, tree, trainer = _train(tmp_path, forkrl=True, kind=kind, **extra)
    rel = relative_difference(stock, tree, init)  # of the update
    print(f"{kind} {extra}: {rel:.2e} of the update")
    if "router_aux_loss_coef" in extra:  # the MoE VLM's router loss is in the update, on both sides
        assert trainer.aux_loss_enabled and any("aux_loss" in h for h in trainer.state.log_history)
    assert rel < 1e-4, rel
    visual = [n for n in tree if "visual" in n or "vision_tower" in n]
    assert visual and any(not torch.equal(tree[n], init[n]) for n in visual)  # the tower trained
    logged = [h for h in trainer.state.log_history if "tree/compression" in h]
    assert logged and all(h["tree/compression"] > 1 for h in logged)


@pytest.mark.parametrize("kind", ["grpo", "grpo-gemma3"])
def test_a_vision_language_model_follows_bf16_autocast(tmp_path, kind):
    """TRL's default precision (``bf16=True``: autocast over float32 parameters), with the reference
    model scored on the tree (``beta > 0``): the tree's update is a bf16 update as accurate as stock's
    (``Bf16Rounding``, as ``test_trl_precision.py`` takes it for text models)."""
    from forkrl.core.testing import Bf16Rounding

    def update(params, init):
        return torch.cat([(params[n].double() - init[n].double()).flatten() for n in sorted(params)])

    init, exact, _ = _train(tmp_path, forkrl=False, kind=kind, beta=0.04)
    _, stock, _ = _train(tmp_path / "bf16", forkrl=False, kind=kind, beta=0.04, bf16=True)
    _, tree, trainer = _train(tmp_path / "bf16", forkrl=True, kind=kind, beta=0.04, bf16=True)
    assert trainer.forkrl is not None and trainer.args.bf16
    exact, stock, tree = update(exact, init), update(stock, init), update(tree, init)
    assert float((stock - exact).norm()) > 1e-4 * float(exact.norm()), "bf16 did not round anything"
    rounding = Bf16Rounding(kind, tree, stock, exact)
    print(f"{kind}: |tree - fp32| {rounding.off:.3f}, |tree - stock| {rounding.near:.3f} of the bf16 gap")
    rounding.check_follows(near=1.5)
