"""A vision-language model (a tiny float32 Qwen2-VL, and Qwen2.5-VL) through veRL's real engines: stock FSDP2 vs forkrl's tree.

Batches are built as veRL's agent loop builds them: each row's ``multi_modal_inputs`` from veRL's
own ``build_multimodal_processor_inputs`` over a Qwen2-VL processor (``pixel_values``,
``image_grid_thw``, veRL's ``images_seqlens``; ``{}`` for a text row) and its ``[4, T]`` position ids
from veRL's own ``AgentLoopWorker._compute_position_ids`` (the model's ``get_rope_index`` bound to
the processor, as veRL binds it). Groups share an image prompt; text rows ride in the same
mini-batch. Stock veRL runs its own Qwen2-VL patches (``apply_monkey_patch``: its model forward and
its packed flash-attention layer); only flash-attention's CUDA kernel is replaced by a CPU stand-in
(:func:`_cpu_flash`: causal attention per packed sequence, found from the text positions).
Runs in the veRL environment (.venv-verl).
"""

from __future__ import annotations

import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from forkrl.core.testing.stock import assert_equals_stock, relative_difference
from forkrl.core.testing.vision import qwen_vl_model, qwen_vl_processor
from forkrl.plugins.verl import testing as h

TOL = 1e-4  # of the update, as tests/verl/test_verl_engine.py


def _cpu_flash(query, key, value, attention_mask, query_length, *args, position_ids=None, **kwargs):
    """veRL's ``_custom_flash_attention_forward`` on the CPU: ``query`` ``[1, S, H, d]``, ``key``/``value``
    ``[1, S, H, d]`` (already repeated), packed sequences restarting ``position_ids`` ``[1, S]`` at 0;
    causal within each (what flash-attention's varlen kernel computes; the mask is not read, as there)."""
    if (
        position_ids is None
        or query.shape[0] != 1
        or kwargs.get("dropout", 0.0)
        or kwargs.get("sliding_window")
    ):
        raise NotImplementedError(
            "the CPU stand-in serves veRL's packed layout, without dropout or sliding window"
        )
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
    rep = query.shape[2] // key.shape[2]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [heads, S, d]
    k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    pieces = [
        F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True)
        for a, b in zip(starts, starts[1:], strict=False)
        if b > a
    ]
    return torch.cat(pieces, dim=1).transpose(0, 1).unsqueeze(0).to(query.dtype)


@pytest.fixture(scope="module", autouse=True)
def cpu_flash():
    from verl.models.transformers import qwen2_vl

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qwen2_vl, "_custom_flash_attention_forward", _cpu_flash)
        # set at import only where flash-attention is installed; read by veRL's attention layer
        mp.setattr(qwen2_vl, "_flash_use_top_left_mask", False, raising=False)
        yield


def _processor(family: str):
    """Qwen2-VL's (Qwen2.5-VL's) processor over the byte tokenizer (a 56x56 image: a 4x4 patch grid,
    4 tokens)."""
    return qwen_vl_processor(family)


def _model(tok, family: str):
    return qwen_vl_model(tok, family, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def setup(request, tmp_path_factory):
    family = request.param
    processor = _processor(family)
    model = _model(processor.tokenizer, family)
    path = tmp_path_factory.mktemp(f"verl-{family}")
    model.save_pretrained(path)
    processor.tokenizer.save_pretrained(path)
    # veRL binds the model's get_rope_index to its processor (verl.utils.tokenizer.hf_processor)
    base = type(model.model)  # Qwen2VLModel / Qwen2_5_VLModel
    processor.config = model.config
    processor.get_rope_index = types.MethodType(base.get_rope_index, processor)
    processor.get_vision_position_ids = types.MethodType(base.get_vision_position_ids, processor)
    return str(path), processor, model


#: Row order: every micro-batch of two holds an image (stock veRL 0.9.1 fails on a text-only
#: micro-batch of Qwen2-VL under transformers 5.10: its dummy image's ``model.visual(...).mean()``,
#: qwen2_vl.py:394). GROUPED puts the two text rows in one micro-batch (for the tree alone).
MIXED = [0, 6, 1, 2, 3, 7, 4, 5]
GROUPED = list(range(8))


def _rollouts(processor, seed: int = 0, order: list[int] = MIXED):
    """Two groups of three responses under an image prompt each (responses extend and repeat one
    another), and two text rows: ``(prompt, response)`` id lists, per row its multi_modal_inputs and
    its ``[4, T]`` position ids, both as veRL's agent loop makes them."""
    from PIL import Image as PILImage
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.utils.tokenizer.tokenizer import build_multimodal_processor_inputs

    rng = np.random.RandomState(seed)
    g = torch.Generator().manual_seed(seed)
    rollouts, mm, positions = [], [], []
    loop = SimpleNamespace(processor=processor)
    for group in range(3):
        image = None if group == 2 else PILImage.fromarray((rng.rand(56, 56, 3) * 255).astype("uint8"))
        content = [{"type": "text", "text": f"Spell color {group}."}]
        if image is not None:
            content.insert(0, {"type": "image"})
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        out = build_multimodal_processor_inputs(
            processor, text=[text], images=None if image is None else [image]
        )
        prompt = out.pop("input_ids")[0].tolist()
        out.pop("attention_mask", None)
        inputs = dict(out.convert_to_tensors("pt"))  # as veRL's _compute_multi_modal_inputs
        if image is not None:
            grid = inputs["image_grid_thw"]
            inputs["images_seqlens"] = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
        stem = torch.randint(40, 120, (4,), generator=g).tolist()
        for k in range(2 if image is None else 3):
            response = stem[: 2 + k] + torch.randint(40, 120, (1 + k,), generator=g).tolist()
            ids = torch.tensor([prompt + response])
            row = dict(inputs)  # veRL pops mm_token_type_ids while computing the positions
            pos = AgentLoopWorker._compute_position_ids(loop, ids, torch.ones_like(ids), row)
            row.pop("mm_token_type_ids", None)
            rollouts.append((prompt, response))
            mm.append(row)
            positions.append(pos[0])  # [4, T]
    return [rollouts[i] for i in order], [mm[i] for i in order], [positions[i] for i in order]


def _batch(processor, seed: int = 0, rows=None):
    from verl.utils import tensordict_utils as tu

    rollouts, mm, positions = rows or _rollouts(processor, seed)
    td = h.batch(rollouts, seed=seed, positions=positions)
    tu.assign_non_tensor_stack(td, "multi_modal_inputs", mm)
    return td


def _pair(path, forkrl: dict | None = None):
    stock = h.worker(path, h.actor_config(None))
    tree = h.worker(path, h.actor_config(forkrl or {"tree_packing": True}))
    assert type(tree.engine).__name__ == "TreeFSDPEngineWithLMHead"
    return stock, tree


def test_host_positions_are_the_cores(setup):
    """veRL's M-RoPE rows and the core's (the model's get_rope_index over the tree's rows) agree,
    which is why the engine does not read veRL's position ids."""
    from forkrl.core.executor.vision import Image, VisionBatch

    _, processor, model = setup
    rollouts, mm, positions = _rollouts(processor)
    images = [
        [Image(p, g) for p, g in zip(torch.split(r["pixel_values"], r["image_grid_thw"].prod(-1).tolist()), r["image_grid_thw"], strict=True)]
        if r else []
        for r in mm
    ]  # fmt: skip
    seqs = [torch.tensor(p + r) for p, r in rollouts]
    with torch.no_grad():
        vision = VisionBatch.prepare(model, seqs, images, grad=False)
    for pos, core in zip(positions, vision.positions, strict=True):
        assert torch.equal(pos[1:], core), (pos, core)
        assert torch.equal(pos[0], torch.arange(pos.shape[1]))


def test_vlm_log_probs_and_update_equal_stock(setup):
    path, processor, _ = setup
    stock, tree = _pair(path)
    init = h.parameters(stock)
    td = _batch(processor, seed=5)
    lp_s, ent_s, _ = h.log_probs(stock, td)
    lp_t, ent_t, _ = h.log_probs(tree, td)
    print(f"log-prob max diff {(lp_t - lp_s).abs().max().item():.2e}")
    torch.testing.assert_close(lp_t, lp_s, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(ent_t, ent_s, rtol=1e-5, atol=2e-5)
    logs = []
    for step in range(2):
        td = _batch(processor, seed=step)
        logs.append((h.update(stock, td, 8, True), h.update(tree, td, 8, True)))
    a, b = h.parameters(tree), h.parameters(stock)
    print(f"parameters: {relative_difference(b, a, init):.2e} of the update")
    assert_equals_stock(b, a, init, TOL, what="forkrl's engine")
    visual = [n for n in b if "visual" in n]
    assert visual and all(not torch.equal(b[n], init[n]) for n in visual if n.endswith("weight")), (
        "the vision tower did not train"
    )
    for ms, mt in logs:
        assert abs(ms["loss"][0] - mt["loss"][0]) <= 1e-4 * max(1.0, abs(ms["loss"][0]))
        assert mt["tree/compression"][0] > 1.0


@pytest.mark.parametrize("tree_mode", ["keep", "replay"])
def test_vlm_old_log_probs_equal_stock(setup, tree_mode):
    """``compute_log_prob`` on the tree (keep and replay modes), and with the two text rows in a
    micro-batch of their own (a text-only micro-batch in a multimodal window; stock cannot run
    one, its rows' log-probs do not depend on the grouping)."""
    path, processor, _ = setup
    forkrl = {"tree_packing": True, "tree_mode": tree_mode}
    if tree_mode == "replay":
        forkrl["tree_block_size"] = 5
    stock, tree = _pair(path, forkrl)
    lp_s, ent_s, _ = h.log_probs(stock, _batch(processor, seed=3), temperature=0.7)
    lp_t, ent_t, _ = h.log_probs(tree, _batch(processor, seed=3), temperature=0.7)
    torch.testing.assert_close(lp_t, lp_s, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(ent_t, ent_s, rtol=1e-5, atol=2e-5)
    grouped = _batch(processor, rows=_rollouts(processor, 3, GROUPED))
    lp_g, _, _ = h.log_probs(tree, grouped, temperature=0.7)
    back = [MIXED.index(i) for i in GROUPED]  # row i of GROUPED is row back[i] of MIXED
    torch.testing.assert_close(lp_g, lp_s[back], rtol=1e-5, atol=2e-6)
    # negative control: other pixels change the image rows' log-probs (the images are read)
    rollouts, mm, positions = _rollouts(processor, 3)
    mm = [{**r, "pixel_values": r["pixel_values"].flip(0)} if r else r for r in mm]
    lp_x, _, _ = h.log_probs(tree, _batch(processor, rows=(rollouts, mm, positions)), temperature=0.7)
    image_rows = [i for i, r in enumerate(mm) if r]
    assert (lp_x[image_rows] - lp_s[image_rows]).abs().max() > 1e-3


def test_packed_mode_is_refused_with_images(setup):
    path, processor, _ = setup
    tree = h.worker(path, h.actor_config({"tree_packing": True, "tree_mode": "packed"}))
    before = h.parameters(tree)
    with pytest.raises(ValueError, match="keep or replay mode"):
        h.update(tree, _batch(processor), 8, True)
    after = h.parameters(tree)
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_video_is_refused_before_anything_changes(setup):
    from forkrl.core import UnsupportedModelError

    path, processor, _ = setup
    tree = h.worker(path, h.actor_config({"tree_packing": True}))
    rollouts, mm, positions = _rollouts(processor)
    mm = list(mm)
    mm[2] = {**mm[2], "pixel_values_videos": torch.zeros(16, mm[2]["pixel_values"].shape[1]),
             "video_grid_thw": torch.tensor([[1, 4, 4]])}  # fmt: skip
    before = h.parameters(tree)
    with pytest.raises(
        UnsupportedModelError,
        match=r"row 2 carries video \(pixel_values_videos, video_grid_thw\).*forkrl.tree_packing=false",
    ):
        h.update(tree, _batch(processor, rows=(rollouts, mm, positions)), 8, True)
    with pytest.raises(UnsupportedModelError, match="carries video"):
        h.log_probs(tree, _batch(processor, rows=(rollouts, mm, positions)))
    after = h.parameters(tree)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert all(p.grad is None or not p.grad.any() for p in tree.engine.module.parameters())


def test_balance_on_is_refused_for_a_vlm(setup):
    path, processor, _ = setup
    tree = h.worker(path, h.actor_config({"tree_packing": True, "tree_balance": "on"}))
    tree.engine.get_data_parallel_size = lambda: 2  # one rank here; the decision is the model's
    with pytest.raises(ValueError, match="tree_balance: on moves rows"):
        tree.engine._balancing(_batch(processor))


def test_a_family_the_core_does_not_serve_is_refused(setup, monkeypatch):
    """The core's refusal of a vision-language family (here: Qwen-VL taken off its list) reaches
    veRL's caller in veRL's words, before any parameter or gradient changed."""
    from forkrl.core import UnsupportedModelError
    from forkrl.core.executor import vision

    path, processor, _ = setup
    tree = h.worker(path, h.actor_config({"tree_packing": True}))
    monkeypatch.setattr(vision, "_SUPPORTED", ("LlavaForConditionalGeneration",))
    before = h.parameters(tree)
    with pytest.raises(
        UnsupportedModelError, match=r"forkrl's tree takes images for .*forkrl.tree_packing=false"
    ):
        h.update(tree, _batch(processor), 8, True)
    after = h.parameters(tree)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert all(p.grad is None or not p.grad.any() for p in tree.engine.module.parameters())


@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_vlm_follows_verls_precision(setup, precision):
    """veRL's mixed precision (float32 parameters, bf16 autocast) and bf16 parameters with images:
    the criterion of ``test_verl_precision.py`` on the update after two ``update_actor`` calls (mixed:
    a bf16 update as accurate as stock's; bf16 parameters: within half of bf16's own gap of stock)."""
    from forkrl.core.testing import Bf16Rounding

    path, processor, _ = setup

    def run(forkrl, precision):
        w = h.worker(path, h.actor_config(forkrl, precision=precision))
        init = {n: p.float() for n, p in h.parameters(w).items()}
        for step in range(2):
            h.update(w, _batch(processor, seed=step), 8, True)
        after = h.parameters(w)
        return torch.cat([(after[n].double() - init[n].double()).flatten() for n in sorted(after)])

    exact, stock, tree = run(None, "fp32"), run(None, precision), run({"tree_packing": True}, precision)
    assert float((stock - exact).norm()) > 1e-4 * float(exact.norm()), "bf16 did not round anything"
    rounding = Bf16Rounding(f"{precision} images", tree, stock, exact)
    print(
        f"{precision}: |tree - fp32| {rounding.off:.3f}, |tree - stock| {rounding.near:.3f} of the bf16 gap"
    )
    if precision == "bf16":
        rounding.check_within_half()
    else:
        rounding.check_follows(near=1.5)
