"""Images on a tree (:mod:`forkrl.core.executor.vision`): Qwen2-VL and Qwen2.5-VL, float64, against
the model's own per-sequence forward with its pixel values (vision tower, ``masked_scatter``,
multimodal RoPE from ``get_rope_index``)."""

from __future__ import annotations

import pytest
import torch

from forkrl.core import PrefixForest, TreeExecutor, UnsupportedModelError
from forkrl.core.executor.vision import Image, VisionBatch
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.models import grads, left_padded, max_rel_err

IMAGE, VIDEO, START, END = 290, 291, 288, 289


def _model(family: str, seed: int = 0, frozen_vision: bool = False):
    import transformers

    text = dict(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=32, num_heads=4, patch_size=2, spatial_merge_size=2, temporal_patch_size=2
    )
    if family == "qwen2_vl":
        vision.update(embed_dim=32, mlp_ratio=2)
        config = transformers.Qwen2VLConfig(
            text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
            vision_start_token_id=START, vision_end_token_id=END,
        )  # fmt: skip
        cls = transformers.Qwen2VLForConditionalGeneration
    elif family == "qwen3_vl":  # deepstack: vision layers 0 and 1 feed decoder layers 0 and 1
        vision.update(
            intermediate_size=64,
            out_hidden_size=32,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1],
        )
        config = transformers.Qwen3VLConfig(
            text_config={**text, "head_dim": 8}, vision_config=vision, image_token_id=IMAGE,
            video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        )  # fmt: skip
        cls = transformers.Qwen3VLForConditionalGeneration
    elif family.startswith("qwen3_5"):  # linear-attention and full-attention layers; the MoE: router logits
        vision.update(intermediate_size=64, out_hidden_size=32, num_position_embeddings=16)
        text.update(
            head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        )  # fmt: skip
        moe = family == "qwen3_5_moe"
        if moe:
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32)  # fmt: skip
        cfg_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
        config = cfg_cls(
            text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
            vision_start_token_id=START, vision_end_token_id=END,
        )  # fmt: skip
        cls = (
            transformers.Qwen3_5MoeForConditionalGeneration
            if moe
            else transformers.Qwen3_5ForConditionalGeneration
        )
        if moe:  # grouped_mm has no float64 kernel
            from forkrl.core import compat

            compat.set_experts_implementation(config, "eager")
    else:
        vision.update(intermediate_size=64, out_hidden_size=32, fullatt_block_indexes=[1], window_size=8)
        config = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
            vision_start_token_id=START, vision_end_token_id=END,
        )  # fmt: skip
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).double().eval()
    if frozen_vision:
        model.model.visual.requires_grad_(False)
    return model


def _image(seed: int, h: int = 4, w: int = 4) -> Image:
    g = torch.Generator().manual_seed(seed)
    return Image(torch.randn(h * w, 3 * 2 * 2 * 2, generator=g, dtype=torch.float64), torch.tensor([1, h, w]))


def _batch():
    """Two GRPO groups whose prompts have the same text and different images, one image twice in a
    prompt, and a text-only row: ``(sequences, images, score_from)``."""
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, 250, (n,), generator=g).tolist()  # noqa: E731
    img_a, img_b = _image(1), _image(2, 4, 8)
    text = rand(5)
    prompt_a = [1, 2, START] + [IMAGE] * 4 + [END] + text
    prompt_b = [1, 2, START] + [IMAGE] * 8 + [END] + text
    prompt_c = [1, START] + [IMAGE] * 4 + [END, 9, START] + [IMAGE] * 4 + [END] + text  # image a twice
    rows = [(prompt_a, [img_a], rand(3 + k)) for k in range(3)]
    rows += [(prompt_b, [img_b], rand(2 + k)) for k in range(2)]
    rows += [(prompt_c, [img_a, img_a], rand(4)), (text, [], rand(3))]
    return [p + r for p, _, r in rows], [i for _, i, _ in rows], [len(p) for p, _, _ in rows]


def _dense(model, sequences, images, score_from, coefs, inputs=None):
    """The model's own forward per sequence; returns log-probs and accumulates the gradient.
    ``inputs(ids, imgs)``: the forward's image arguments (default: the Qwen-VL family's)."""
    lps = []
    for seq, imgs, sf, c in zip(sequences, images, score_from, coefs, strict=True):
        lp = _dense_logprobs_in_graph(model, seq, imgs, sf, inputs)
        (lp * c).sum().backward()
        lps.append(lp.detach())
    return lps


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("mode", ["keep", "replay"])
def test_images_on_a_tree_equal_the_models_forward(family, mode):
    """Log-probs and every parameter's gradient (vision tower included) equal the model's own
    per-sequence forward and backward in float64; each unique image runs through the tower once;
    prompts of equal text and different images do not share past the image."""
    sequences, images, score_from = _batch()
    g = torch.Generator().manual_seed(3)
    coefs = [
        torch.randn(len(s) - sf, generator=g, dtype=torch.float64)
        for s, sf in zip(sequences, score_from, strict=True)
    ]
    with Float64Mode():
        model = _model(family)
        want = _dense(model, sequences, images, score_from, coefs)
        want_grads = grads(model)
        model.zero_grad(set_to_none=True)
        calls = []
        handle = model.model.visual.register_forward_hook(lambda *a: calls.append(1))
        vision = VisionBatch.prepare(model, sequences, images)
        forest = PrefixForest.build(vision.sequences, score_from)
        ex = TreeExecutor(model, mode=mode, block_size=3 if mode == "replay" else None)
        scored = ex.score(forest, vision=VisionBatch.prepare(model, sequences, images, grad=False))
        got = ex.backward(forest, grad_logprobs=coefs, vision=vision)
        handle.remove()
    assert vision.unique_images == 2 and len(calls) == 2  # one prepare per pass: each ran the tower once
    assert forest.unique_tokens < forest.dense_tokens
    # the two groups share the text before the image only: [1, 2, START]
    a, b = forest.paths[0], forest.paths[3]
    shared = [n for n in a if n in b]
    assert sum(len(forest.nodes[n].tokens) for n in shared) == 3, shared
    assert max_rel_err(scored.logprobs, want) < 1e-12
    assert max_rel_err(got.logprobs, want) < 1e-12
    err = max_rel_err(grads(model), want_grads)
    assert err < 1e-10, err
    # the tower's gradient arrived wherever the model's own has one (Qwen3-VL's learned position
    # table has rows a 4x4 grid does not read)
    names = [n for n, _ in model.named_parameters()]
    tower = [i for i, n in enumerate(names) if ".visual." in f".{n}" and want_grads[i].abs().sum() > 0]
    assert tower and all(grads(model)[i].abs().sum() > 0 for i in tower)


def test_a_frozen_vision_tower_gets_no_backward():
    """With the vision tower frozen the tree keeps no vision graph (as stock computes no gradient
    there) and the language model's gradient still equals the model's own."""
    sequences, images, score_from = _batch()
    coefs = [
        torch.ones(len(s) - sf, dtype=torch.float64) for s, sf in zip(sequences, score_from, strict=True)
    ]
    with Float64Mode():
        model = _model("qwen2_vl", frozen_vision=True)
        _dense(model, sequences, images, score_from, coefs)
        want = grads(model)
        model.zero_grad(set_to_none=True)
        vision = VisionBatch.prepare(model, sequences, images)
        assert vision._graph is None and not vision.rows.requires_grad
        forest = PrefixForest.build(vision.sequences, score_from)
        TreeExecutor(model).backward(forest, grad_logprobs=coefs, vision=vision)
    assert max_rel_err(grads(model), want) < 1e-10
    assert all(p.grad is None for p in model.model.visual.parameters())


def test_refusals_name_the_way_out_and_change_nothing():
    sequences, images, score_from = _batch()
    model = _model("qwen2_vl")
    vision = VisionBatch.prepare(model, sequences, images)
    forest = PrefixForest.build(vision.sequences, score_from)
    coefs = [
        torch.ones(len(s) - sf, dtype=torch.float64) for s, sf in zip(sequences, score_from, strict=True)
    ]
    with pytest.raises(UnsupportedModelError, match="keep or replay mode"):
        TreeExecutor(model, mode="packed").backward(forest, grad_logprobs=coefs, vision=vision)
    plain = PrefixForest.build(sequences, score_from)  # image placeholders, not the batch's ids
    with pytest.raises(ValueError, match="build it from .sequences"):
        TreeExecutor(model).backward(plain, grad_logprobs=coefs, vision=vision)
    assert all(p.grad is None for p in model.parameters())  # nothing was accumulated
    with pytest.raises(ValueError, match="has 4 image placeholder tokens but its 0 image"):
        VisionBatch.prepare(model, sequences[:1], [[]])
    with pytest.raises(UnsupportedModelError, match="video tokens"):
        VisionBatch.prepare(model, [[1, VIDEO, 2]], [[]])
    from forkrl.core.testing.models import byte_llama

    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM: forkrl's tree takes images for"):
        VisionBatch.prepare(byte_llama(0), [[1, 2]], [[]])


@pytest.mark.parametrize("mode", ["keep", "replay"])
def test_images_on_a_tree_follow_bf16_autocast(mode):
    """Under bf16 autocast over float32 weights the tree is a bf16 computation as accurate as the
    model's own (the precision tests' criterion, on the log-probs and on all gradients)."""
    from forkrl.core.testing import Bf16Rounding

    sequences, images, score_from = _batch()
    g = torch.Generator().manual_seed(3)
    coefs = [torch.randn(len(s) - sf, generator=g) for s, sf in zip(sequences, score_from, strict=True)]
    images = [[Image(i.pixel_values.float(), i.grid_thw) for i in imgs] for imgs in images]
    model = _model("qwen2_5_vl").float()

    def dense(autocast: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lps = _dense(model, sequences, images, score_from, coefs)
        return torch.cat(lps), torch.cat([t.flatten() for t in grads(model)])

    (exact_lp, exact_g), (stock_lp, stock_g) = dense(False), dense(True)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        vision = VisionBatch.prepare(model, sequences, images)
        forest = PrefixForest.build(vision.sequences, score_from)
        got = TreeExecutor(model, mode=mode, block_size=3 if mode == "replay" else None).backward(
            forest, grad_logprobs=coefs, vision=vision
        )
    tree_g = torch.cat([t.flatten() for t in grads(model)])
    Bf16Rounding(f"{mode} log-probs", torch.cat(got.logprobs), stock_lp, exact_lp).check_follows(near=1.5)
    Bf16Rounding(f"{mode} gradient", tree_g, stock_g, exact_g).check_follows(near=1.5)


@pytest.mark.parametrize("gradient", ["general", "token_local"])
def test_tree_step_trains_images_with_a_host_loss(gradient):
    """:class:`TreeStep` with ``images``: a clipped-ratio host loss on padded micro-batches (the
    rows of two micro-batches, images per row) equals the model's own forward; ``score_window``
    equals its log-probs."""
    from forkrl.core import RowLayout, TreeOptions, TreeStep
    from forkrl.core.train import StepInputs, StepLoss

    sequences, images, score_from = _batch()
    split = [range(0, 4), range(4, len(sequences))]
    layouts, masks, olds = [], [], []
    for rows in split:
        P = max(score_from[i] for i in rows)
        C = max(len(sequences[i]) - score_from[i] for i in rows)
        ids, mask = left_padded(
            [(sequences[i][: score_from[i]], sequences[i][score_from[i] :]) for i in rows]
        )
        layouts.append(RowLayout.padded(ids, mask, C))
        masks.append(mask[:, P:].double())
        olds.append(
            torch.randn(len(rows), C, generator=torch.Generator().manual_seed(len(rows)), dtype=torch.float64)
            * 0.1
            - 4
        )

    def loss_fn(i, lp, ent):
        ratio = torch.exp(lp - olds[i])
        return -(torch.minimum(ratio, ratio.clamp(0.8, 1.2)) * masks[i]).sum() / masks[i].sum()

    with Float64Mode():
        model = _model("qwen2_5_vl")
        total = 0
        for k, rows in enumerate(split):  # the model's own forward per micro-batch (rows one by one)
            lps = []
            for i in rows:
                lps.append(_dense_logprobs_in_graph(model, sequences[i], images[i], score_from[i]))
            lp = torch.zeros_like(masks[k])
            for b, row in enumerate(lps):
                lp = lp.index_put((torch.tensor([b]), torch.arange(len(row))), row)
            total = total + loss_fn(k, lp, None)
        total.backward()
        want = grads(model)
        model.zero_grad(set_to_none=True)
        step = TreeStep(TreeOptions(tree_packing=True))
        scored = step.score_window(model, layouts, images=images)
        step.train(model, StepInputs(layouts, images), StepLoss(loss_fn, gradient, entropy=False))
        refs = [
            [_dense_logprobs_in_graph(model, sequences[i], images[i], score_from[i]).detach() for i in rows]
            for rows in split
        ]
    assert max_rel_err(grads(model), want) < 1e-10
    for k, rows in enumerate(split):
        for b, i in enumerate(rows):
            n = len(sequences[i]) - score_from[i]
            assert torch.allclose(scored[k][0][b, :n], refs[k][b], rtol=0, atol=1e-10)


def _dense_logprobs_in_graph(model, seq, imgs, sf, inputs=None):
    """One sequence's scored log-probs from the model's own forward with its pixel values (the
    log-softmax in float32, as hosts take it)."""
    ids = torch.tensor(seq)[None]
    kwargs = {}
    if inputs is not None:
        kwargs = inputs(ids, imgs)
    elif imgs:
        kwargs = dict(
            pixel_values=torch.cat([i.pixel_values for i in imgs]),
            image_grid_thw=torch.stack([i.grid_thw for i in imgs]),
            mm_token_type_ids=(ids == IMAGE).int(),
        )
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits[0]
    return torch.log_softmax(logits.float(), -1)[sf - 1 : -1].gather(-1, ids[0, sf:, None])[:, 0]


def _llava(seed: int = 0):
    """A tiny LLaVA: CLIP tower (8x8 images, patch 2: 16 rows after dropping CLS), Llama decoder."""
    import transformers

    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=8,
            patch_size=2,
        ),
        text_config=transformers.LlamaConfig(
            vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512,
        ),
        image_token_index=IMAGE, vision_feature_layer=-2, vision_feature_select_strategy="default",
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlavaForConditionalGeneration(config).double().eval()


@pytest.mark.parametrize("mode", ["keep", "replay"])
def test_llava_images_on_a_tree_equal_the_models_forward(mode):
    """A LLaVA-style model (image features spliced into the text embeddings, positions by depth):
    float64 log-probs and every gradient (tower and projector included) equal its own forward."""
    g = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(0, 250, (n,), generator=g).tolist()  # noqa: E731
    a, b = (
        Image(torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(s), dtype=torch.float64))
        for s in (1, 2)
    )
    text = rand(4)
    rows = [([1, 2] + [IMAGE] * 16 + text, [a], rand(2 + k)) for k in range(3)]
    rows += [
        ([1, 2] + [IMAGE] * 16 + text, [b], rand(3)),
        ([1] + [IMAGE] * 16 + [9] + [IMAGE] * 16, [a, a], rand(2)),
    ]
    rows += [(text, [], rand(3))]
    sequences, images, score_from = (
        [p + r for p, _, r in rows],
        [i for _, i, _ in rows],
        [len(p) for p, _, _ in rows],
    )
    coefs = [
        torch.randn(len(s) - sf, generator=g, dtype=torch.float64)
        for s, sf in zip(sequences, score_from, strict=True)
    ]
    with Float64Mode():
        model = _llava()
        want = _dense(
            model,
            sequences,
            images,
            score_from,
            coefs,
            inputs=lambda ids, imgs: (
                {"pixel_values": torch.stack([i.pixel_values for i in imgs])} if imgs else {}
            ),
        )
        want_grads = grads(model)
        model.zero_grad(set_to_none=True)
        vision = VisionBatch.prepare(model, sequences, images)
        forest = PrefixForest.build(vision.sequences, score_from)
        got = TreeExecutor(model, mode=mode, block_size=5 if mode == "replay" else None).backward(
            forest, grad_logprobs=coefs, vision=vision
        )
    assert vision.unique_images == 2
    assert max_rel_err(got.logprobs, want) < 1e-12
    assert max_rel_err(grads(model), want_grads) < 1e-10
    projector = [p.grad for p in model.model.multi_modal_projector.parameters()]
    assert all(p is not None and p.abs().sum() > 0 for p in projector)


@pytest.mark.parametrize("mode", ["keep", "replay"])
def test_llava_next_images_on_a_tree_equal_the_models_forward(mode):
    """LLaVA-NeXT (each image cut into crops by its size, rows packed with ``image_newline``; a
    batch's crops padded to the most): float64 log-probs and gradients equal its own forward, the
    padding crops dropped before an image is keyed."""
    import transformers

    config = transformers.LlavaNextConfig(
        text_config=dict(model_type="llama", vocab_size=300, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=8, patch_size=2),
        image_token_index=IMAGE, image_grid_pinpoints=[[8, 8], [8, 16], [16, 8], [16, 16]],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlavaNextForConditionalGeneration(config).double().eval()
    g = torch.Generator().manual_seed(6)
    crops = lambda n: torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64)  # noqa: E731
    a = Image(crops(3), image_size=torch.tensor([8, 14]))  # two tiles and the overview
    b = Image(crops(2), image_size=torch.tensor([8, 8]))
    padded_b = Image(
        torch.cat([b.pixel_values, torch.zeros(1, 3, 8, 8, dtype=torch.float64)]), image_size=b.image_size
    )
    with torch.no_grad():
        rows = [f.shape[0] for f in model.model.get_image_features(
            pixel_values=torch.cat([a.pixel_values, b.pixel_values]), image_sizes=torch.stack([a.image_size, b.image_size]),
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        ).pooler_output]  # fmt: skip
    rand = lambda n: torch.randint(0, 250, (n,), generator=g).tolist()  # noqa: E731
    text = rand(4)
    rows_ = [([1, 2] + [IMAGE] * rows[0] + text, [a], rand(2 + k)) for k in range(3)]
    rows_ += [
        ([1, 2] + [IMAGE] * rows[1] + text, [b], rand(3)),
        ([1, 2] + [IMAGE] * rows[1] + text, [padded_b], rand(2)),
    ]
    sequences = [p + r for p, _, r in rows_]
    images = [i for _, i, _ in rows_]
    score_from = [len(p) for p, _, _ in rows_]
    coefs = [
        torch.randn(len(s) - sf, generator=g, dtype=torch.float64)
        for s, sf in zip(sequences, score_from, strict=True)
    ]
    with Float64Mode():
        want = _dense(
            model,
            sequences,
            images,
            score_from,
            coefs,
            inputs=lambda ids, imgs: {
                "pixel_values": imgs[0].pixel_values[None],
                "image_sizes": imgs[0].image_size[None],
            },
        )
        want_grads = grads(model)
        model.zero_grad(set_to_none=True)
        vision = VisionBatch.prepare(model, sequences, images)
        forest = PrefixForest.build(vision.sequences, score_from)
        got = TreeExecutor(model, mode=mode, block_size=5 if mode == "replay" else None).backward(
            forest, grad_logprobs=coefs, vision=vision
        )
    assert vision.unique_images == 2  # b and its padded copy are one image
    assert max_rel_err(got.logprobs, want) < 1e-12
    assert max_rel_err(grads(model), want_grads) < 1e-10
    assert model.model.image_newline.grad is not None and model.model.image_newline.grad.abs().sum() > 0


def _gemma3(seed: int = 0):
    """A tiny Gemma 3: SigLIP tower (8x8 images, patch 2, pooled to 4 rows), a sliding-window layer
    (window 6) and a full one."""
    import transformers

    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=8, patch_size=2, vision_use_head=False),
        image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END, mm_tokens_per_image=4,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.Gemma3ForConditionalGeneration(config).double().eval()


def _gemma3_inputs(ids, imgs) -> dict:
    """Gemma 3's forward arguments: its pixels and token types (the image tokens attend both ways)."""
    pixels = {"pixel_values": torch.stack([i.pixel_values for i in imgs])} if imgs else {}
    return {"token_type_ids": (ids == IMAGE).long(), **pixels}


def _gemma3_rows():
    g = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(0, 250, (n,), generator=g).tolist()  # noqa: E731
    a, b = (Image(torch.randn(3, 8, 8, generator=g, dtype=torch.float64)) for _ in range(2))
    text = rand(3)
    img = [START] + [IMAGE] * 4 + [END]
    rows = [([2] + img + text, [a], rand(3 + k)) for k in range(3)]
    rows += [
        ([2] + img + text, [b], rand(4)),
        ([2] + img + [9] + img + text, [a, b], rand(2)),
        (text, [], rand(3)),
    ]
    coefs = [torch.randn(len(r), generator=g, dtype=torch.float64) for _, _, r in rows]
    return [p + r for p, _, r in rows], [i for _, i, _ in rows], [len(p) for p, _, _ in rows], coefs


@pytest.mark.parametrize("mode", ["keep", "replay"])
def test_gemma3_images_attend_both_ways_on_a_tree(mode):
    """Gemma 3 (an image's tokens attend to each other both ways, as its forward does with
    ``token_type_ids``; a sliding-window layer): float64 log-probs and gradients equal its own
    forward; a replay block that would cut an image is refused before anything changed."""
    sequences, images, score_from, coefs = _gemma3_rows()
    with Float64Mode():
        model = _gemma3()
        want = _dense(model, sequences, images, score_from, coefs, inputs=_gemma3_inputs)
        want_grads = grads(model)
        model.zero_grad(set_to_none=True)
        vision = VisionBatch.prepare(model, sequences, images)
        forest = PrefixForest.build(vision.sequences, score_from)
        if mode == "replay":  # a block of 3 cuts the first image (positions 2..5)
            with pytest.raises(UnsupportedModelError, match="both ways within an image"):
                TreeExecutor(model, mode="replay", block_size=3).backward(
                    forest, grad_logprobs=coefs, vision=vision
                )
            assert all(p.grad is None for p in model.parameters())
            vision = VisionBatch.prepare(model, sequences, images)
        ex = TreeExecutor(model, mode=mode, block_size=16 if mode == "replay" else None)
        got = ex.backward(forest, grad_logprobs=coefs, vision=vision)
    assert vision.unique_images == 2
    assert max_rel_err(got.logprobs, want) < 1e-12
    assert max_rel_err(grads(model), want_grads) < 1e-10
    # causal attention within the image would differ: the masks are not the decoder's defaults
    with Float64Mode(), torch.no_grad():
        ids = torch.tensor(sequences[0])[None]
        px = images[0][0].pixel_values[None]
        causal = model(input_ids=ids, pixel_values=px, use_cache=False).logits
        both = model(
            input_ids=ids, pixel_values=px, token_type_ids=(ids == IMAGE).long(), use_cache=False
        ).logits
    assert not torch.allclose(causal, both)


def test_processor_images_reads_a_rows_outputs_and_refuses_what_it_cannot_place():
    """One row's processor outputs as images: split by the grids, text rows none; video, unknown
    fields and grids that miss the patches refused with the host's words; a host's own extra key kept out."""
    from forkrl.core.executor.vision import processor_images

    pixels = torch.randn(24, 6)
    two = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 4]])}
    got = processor_images(two, "row 0", "inputs", "turn it off")
    assert [img.grid_thw.tolist() for img in got] == [[1, 4, 4], [1, 2, 4]]
    assert torch.equal(got[0].pixel_values, pixels[:16]) and torch.equal(got[1].pixel_values, pixels[16:])
    llava = processor_images({"pixel_values": torch.randn(2, 3, 4, 4)}, "row 0", "inputs", "x")
    assert [tuple(img.pixel_values.shape) for img in llava] == [(3, 4, 4)] * 2
    assert processor_images({}, "row 1", "inputs", "x") == []
    assert processor_images(None, "row 1", "inputs", "x") == []
    assert processor_images({"pixel_values": None, "video_grid_thw": None}, "row 1", "inputs", "x") == []
    extra = {**two, "images_seqlens": torch.tensor([4, 2])}
    assert len(processor_images(extra, "row 0", "inputs", "x", ignored=("images_seqlens",))) == 2
    with pytest.raises(
        UnsupportedModelError, match=r"row 2 carries video \(pixel_values_videos, second_per_grid_ts\).*; off"
    ):
        processor_images(
            {**two, "pixel_values_videos": pixels, "second_per_grid_ts": [1.0]}, "row 2", "inputs", "off"
        )
    with pytest.raises(UnsupportedModelError, match=r"row 0's inputs holds .*images_seqlens.*; off"):
        processor_images(extra, "row 0", "inputs", "off")
    with pytest.raises(UnsupportedModelError, match="pixel_values"):
        processor_images({"image_grid_thw": two["image_grid_thw"]}, "row 0", "inputs", "off")
    with pytest.raises(
        ValueError, match=r"row 0: image_grid_thw .* makes 24 patches but pixel_values has 20; off"
    ):
        processor_images({**two, "pixel_values": pixels[:20]}, "row 0", "inputs", "off")
