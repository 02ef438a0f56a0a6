"""forkrl's OpenRLHF trainer and actors on a vision-language actor (a tiny Qwen2-VL, float32, built
from a config; its processor built offline over the byte tokenizer) against OpenRLHF's own.

The experiences are built as OpenRLHF builds them: each prompt through OpenRLHF's
``process_prompt_with_images`` (its ``mm_train_inputs``: ``pixel_values`` and ``image_grid_thw``),
one ``Experience`` per response as its ``SamplesGenerator`` makes it (the action span marked over the
whole sequence), concatenated, and log-probs from ``RemoteExperienceMaker.make_experience`` through
the actors' ``forward`` with ``mm_train_inputs_list``. Then stock ``ActorPPOTrainer`` and forkrl's
train on identical copies through the real replay buffer, ``ppo_train`` and DeepSpeed engine.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from forkrl.core import UnsupportedModelError
from forkrl.core.testing.models import max_rel_err
from forkrl.core.testing.vision import qwen_vl_model, qwen_vl_processor
from forkrl.plugins.openrlhf import testing as h

PROMPT = "user: <|vision_start|><|image_pad|><|vision_end|>Spell color {}. assistant: "


@functools.cache
def _processor():
    """Qwen2-VL's processor over the byte tokenizer: a 56x56 image makes a 1x4x4 grid, 16 patches,
    4 placeholder tokens."""
    return qwen_vl_processor(chat_template=None)


def _model() -> torch.nn.Module:
    """A tiny Qwen2-VL (M-RoPE, a 2-layer vision tower), float32, seed 0."""
    return qwen_vl_model(_processor().tokenizer)


def _samples(
    seed: int, groups: int = 2, n: int = 4, text_group: bool = False, two_images: bool = False
) -> list:
    """One ``Experience`` per response, as OpenRLHF's ``SamplesGenerator`` builds it from a rollout
    (``samples_generator.py``): ``[1, T]`` sequences, the action span marked in ``[1, T - 1]``,
    ``images`` and ``mm_train_inputs`` one entry per sample. ``groups`` prompts with ``n`` responses
    each (some extend others); with ``text_group`` the last prompt has no image, with ``two_images``
    the first has two."""
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.utils.vlm_utils import process_prompt_with_images
    from PIL import Image

    rng = np.random.RandomState(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for q in range(groups):
        text_only = text_group and q == groups - 1
        image = Image.fromarray((rng.rand(56, 56, 3) * 255).astype("uint8"))
        prompt = PROMPT.format(10 * seed + q)
        if text_only:
            prompt = prompt.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
        images = [image]
        if two_images and q == 0:
            prompt = prompt.replace(
                "<|vision_end|>", "<|vision_end|><|vision_start|><|image_pad|><|vision_end|>", 1
            )
            images.append(Image.fromarray((rng.rand(56, 56, 3) * 255).astype("uint8")))
        prompt_ids, mm, _ = process_prompt_with_images(_processor(), prompt, None if text_only else images)
        first = torch.randint(0, 250, (7,), generator=g).tolist()
        for k in range(n):
            r = (
                first[: 1 + (k * 3) % 7]
                if k % 2
                else torch.randint(0, 250, (1 + (k * 5) % 7,), generator=g).tolist()
            )
            ids = torch.tensor(prompt_ids + r)
            action = torch.zeros_like(ids)
            action[len(prompt_ids) :] = 1
            out.append(
                Experience(
                    sequences=ids[None], attention_mask=torch.ones_like(ids)[None], action_mask=action[1:][None],
                    prompts=[prompt], labels=[""], images=[None if text_only else images], mm_train_inputs=[mm],
                    rewards=torch.rand(1, generator=g), response_length=torch.tensor([len(r)]),
                    truncated=torch.tensor([False]), total_length=torch.tensor([len(ids)]), info={},
                )
            )  # fmt: skip
    return out


class _Group:
    """One in-process actor for a Ray actor group: its method per micro-batch, as the workers run it."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def async_run_method_batch(self, method_name, **kwargs):
        calls = [dict(zip(kwargs, values, strict=True)) for values in zip(*kwargs.values(), strict=True)]
        return [[getattr(self.actor, method_name)(**c) for c in calls]]


def _make_experiences(t, samples, policy_cls, reference_cls, monkeypatch) -> list:
    """OpenRLHF's ``make_experience`` over ``samples`` (concatenated 4 per micro-batch, as its
    experience maker's input), policy and reference actors of the given classes on ``t``'s model."""
    from openrlhf.trainer.ppo_utils import experience_maker
    from openrlhf.trainer.ppo_utils.experience import Experience

    from forkrl.core import TreeStep
    from forkrl.plugins.deepspeed import gathered
    from forkrl.plugins.openrlhf.options import options_from

    monkeypatch.setattr(experience_maker, "ray", SimpleNamespace(put=lambda x: x, get=lambda x: x))
    policy = object.__new__(policy_cls)
    policy.actor, policy.trainer, policy.strategy = t.actor, t, t.strategy
    reference = object.__new__(reference_cls)
    reference.model, reference.strategy = t.actor, t.strategy
    options = getattr(t, "tree_options", None) or options_from(t.strategy.args)
    reference.tree_step = TreeStep(options, temperature=t.actor.temperature, gather=gathered)
    maker = object.__new__(experience_maker.RemoteExperienceMaker)
    maker.strategy, maker.args = t.strategy, t.strategy.args
    maker.actor_model_group, maker.initial_model_group = _Group(policy), _Group(reference)
    maker.critic_model_group = maker.reward_model_group = None
    batches = [
        Experience.concat_experiences(h._copy(samples[i : i + 4]), 0) for i in range(0, len(samples), 4)
    ]
    with h.cpu():
        return maker.make_experience(batches)


def _with_advantages(experiences, seed: int) -> list:
    """GRPO-like per-sequence advantages over each row's actions (what the trainer reads)."""
    g = torch.Generator().manual_seed(seed)
    for e in experiences:
        mask = e.action_mask.float()
        e.advantages = torch.randn(mask.shape[0], 1, generator=g) * mask
        e.returns = e.advantages.clone()
    return experiences


KL_ENTROPY = ["--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--algo.kl.init_coef", "0.05",
              "--actor.entropy_coef", "0.01", "--train.max_epochs", "2"]  # fmt: skip


def _args(*extra: str):
    return h.parse_args(h.command("unused", *extra, "--forkrl.tree_packing"))


def _rounds(
    args, monkeypatch, text_group: bool = False, two_images: bool = False, seed: int = 0
) -> list[list]:
    """Two rollout rounds of 8 samples (2 images x 4 responses): experiences made by OpenRLHF's own
    actors on the initial model (the same for both trainers)."""
    from openrlhf.trainer.ray.launcher import ReferenceModelActor
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    maker = h.trainer(args, forkrl=False, model=_model(), vlm=True)
    rounds = []
    for r in range(2):
        made = _make_experiences(
            maker,
            _samples(seed=seed + r, text_group=text_group and r == 1, two_images=two_images),
            PolicyModelActor.__ray_actor_class__,
            ReferenceModelActor.__ray_actor_class__,
            monkeypatch,
        )
        rounds.append(_with_advantages(made, seed=seed + r))
    return rounds


def _train(args, tree: bool, rounds, bf16: bool = False, model=_model):
    t = h.trainer(args, forkrl=tree, model=model(), bf16=bf16, vlm=True)
    statuses = []
    for experiences in rounds:
        h.fill(t, experiences)
        torch.manual_seed(123)  # the DataLoader's shuffle
        with h.cpu():
            statuses.append(t.ppo_train(0.05))
        t.replay_buffer.clear()
    return t, statuses


def _distance(a: dict, b: dict) -> float:
    return float(torch.cat([(a[n].float() - b[n].float()).flatten() for n in a]).norm())


# (name, a text-only prompt in the second round, ZeRO stage, vision tower frozen)
CASES = [
    ("images", False, "2", False),
    ("with-a-text-prompt", True, "2", False),
    ("two-images-in-a-prompt", False, "2", False),
    ("zero-stage-3", False, "3", False),
    ("frozen-vision-tower", False, "2", True),
]


@pytest.mark.parametrize("name,text_group,stage,frozen", CASES, ids=[c[0] for c in CASES])
def test_vlm_tree_trainer_matches_stock(monkeypatch, name, text_group, stage, frozen):
    """Four SGD steps (two rounds, two epochs; KL k3 loss, entropy) on identical VLM experiences:
    forkrl's parameters equal stock's, the vision tower's included, and the tree shares prefixes.
    Frozen: the tower's parameters do not train (``--actor.freeze_visual_encoder``, set as ``Actor``
    sets it)."""
    from forkrl.core import TreeStep

    args = _args(*KL_ENTROPY, "--ds.zero_stage", stage)
    rounds = _rounds(args, monkeypatch, text_group, two_images=name == "two-images-in-a-prompt")

    def model():
        m = _model()
        for n, p in m.named_parameters():  # as Actor.__init__ freezes with freeze_visual_encoder
            p.requires_grad_(not frozen or "language_model" in n or "lm_head" in n)
        return m

    stock, s_status = _train(args, tree=False, rounds=rounds, model=model)
    with_images = []
    real = TreeStep.train
    monkeypatch.setattr(
        TreeStep,
        "train",
        lambda self, *a, **k: with_images.append(a[1].images is not None) or real(self, *a, **k),
    )
    tree, t_status = _train(args, tree=True, rounds=rounds, model=model)
    assert any(with_images)  # the windows' images reached the tree
    before = {n: p.detach() for n, p in _model().named_parameters()}
    p_stock, p_tree = h.parameters(stock), h.parameters(tree)
    change = _distance(p_stock, before)
    rel = _distance(p_tree, p_stock) / change
    print(f"vlm float32 {name}: update {change:.3e}, tree-stock {rel:.2e} of it")
    assert change > 1e-2, "the update is too small to compare"
    assert rel < 5e-6, f"parameters differ by {rel:.2e} of the update"
    visual = [n for n in before if "visual" in n]
    tower_change = _distance({n: p_stock[n] for n in visual}, {n: before[n] for n in visual})
    if frozen:
        assert (
            tower_change == 0
            and _distance({n: p_tree[n] for n in visual}, {n: before[n] for n in visual}) == 0
        )
    else:
        assert tower_change > 0  # the tower trained, and as stock's did
        assert (
            _distance({n: p_tree[n] for n in visual}, {n: p_stock[n] for n in visual}) < 5e-6 * tower_change
        )
    for a, b in zip(s_status, t_status, strict=True):
        for key in ("policy_loss", "kl", "entropy_loss", "actor_grad_norm"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])
        assert b["tree/compression"] > 1.0


def test_vlm_bf16_tree_is_within_bf16_rounding_of_stock(monkeypatch):
    """DeepSpeed's bf16 mode (OpenRLHF's default dtype): forkrl's parameters after the steps are
    within half of stock bf16's distance to stock float32, i.e. within bf16's own rounding noise."""
    args = _args("--actor.entropy_coef", "0.01")
    rounds = _rounds(args, monkeypatch)
    exact = h.parameters(_train(args, tree=False, rounds=rounds)[0])
    stock = h.parameters(_train(args, tree=False, rounds=rounds, bf16=True)[0])
    tree = h.parameters(_train(args, tree=True, rounds=rounds, bf16=True)[0])
    before = {n: p.detach().to(torch.bfloat16).float() for n, p in _model().named_parameters()}
    change = _distance(stock, before)
    print(
        f"vlm bf16: tree-stock {_distance(tree, stock) / change:.3f}, stock bf16-fp32 "
        f"{_distance(stock, exact) / change:.3f} of the update"
    )
    assert change > 1e-2
    assert _distance(tree, stock) < 0.5 * _distance(stock, exact)


def test_experience_maker_vlm_samples_are_tree_scored(monkeypatch):
    """OpenRLHF's own experience maker on VLM samples: forkrl's policy and reference actors score
    on the tree with each row's images, and their log-probs and KL equal OpenRLHF's own actors'."""
    from openrlhf.trainer.ray.launcher import ReferenceModelActor
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    from forkrl.core import TreeStep
    from forkrl.plugins.openrlhf import actors

    args = _args()
    t = h.trainer(args, forkrl=True, model=_model(), vlm=True)
    samples = _samples(seed=3, text_group=True)
    scored = []
    real = TreeStep.score_window
    monkeypatch.setattr(
        TreeStep,
        "score_window",
        lambda self, *a, **k: scored.append(k.get("images") or a[3]) or real(self, *a, **k),
    )
    ours = _make_experiences(
        t, samples, actors.TreePolicyModelActor, actors.TreeReferenceModelActor, monkeypatch
    )
    # policy and reference, both micro-batches: the first with its images, the second text only
    assert len(scored) == 4 and sum(images is not None for images in scored) == 2
    stock = _make_experiences(
        t, samples, PolicyModelActor.__ray_actor_class__, ReferenceModelActor.__ray_actor_class__, monkeypatch
    )
    assert len(scored) == 4
    for a, b in zip(ours, stock, strict=True):
        print(
            f"vlm scoring: log-probs max rel err {max_rel_err([a.action_log_probs], [b.action_log_probs]):.2e}"
        )
        assert max_rel_err([a.action_log_probs], [b.action_log_probs]) < 1e-5
        assert max_rel_err([a.kl], [b.kl]) < 1e-3 * max(1.0, float(b.kl.abs().max()))


def test_row_images_splits_each_sample_by_its_grids():
    """A sample's ``pixel_values`` split per image by ``image_grid_thw`` (``prod(grid)`` rows each);
    text samples get none; an actor's nested ``mm_train_inputs_list`` reads the same; a mismatch is refused."""
    from forkrl.plugins.openrlhf.trainer import row_images

    pixels = torch.randn(24, 6)
    two = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 4]])}
    rows = row_images([two, None, {}], 3)
    assert [len(r) for r in rows] == [2, 0, 0]
    assert torch.equal(rows[0][0].pixel_values, pixels[:16]) and torch.equal(
        rows[0][1].pixel_values, pixels[16:]
    )
    assert rows[0][1].grid_thw.tolist() == [1, 2, 4]
    assert [len(r) for r in row_images([[two, None], [None]], 3)] == [2, 0, 0]
    assert row_images([[None], [None]], 2) is None and row_images([], 2) is None
    with pytest.raises(ValueError, match="2 samples for 3 rows"):
        row_images([two, None], 3)
    with pytest.raises(ValueError, match="makes 24 patches but pixel_values has 20"):
        row_images([{**two, "pixel_values": pixels[:20]}], 1)
    with pytest.raises(UnsupportedModelError, match="pixel_attention_mask"):
        row_images([{**two, "pixel_attention_mask": torch.ones(2)}], 1)


def _grads(t) -> list:
    return [p.grad for p in t.actor.model.module.parameters() if p.grad is not None and bool(p.grad.any())]


def test_video_is_refused_before_anything_changes(monkeypatch):
    """A sample carrying video (``pixel_values_videos``): training refuses it with the way out named,
    and no parameter or gradient has changed; scoring refuses it too."""
    from forkrl.plugins.openrlhf import actors

    args = _args()
    rounds = _rounds(args, monkeypatch)
    for e in rounds[0]:
        for mm in e.mm_train_inputs:
            mm["pixel_values_videos"] = torch.zeros(16, 1176)
            mm["video_grid_thw"] = torch.tensor([[1, 4, 4]])
    t = h.trainer(args, forkrl=True, model=_model(), vlm=True)
    before = {n: p.clone() for n, p in h.parameters(t).items()}
    h.fill(t, rounds[0])
    with pytest.raises(UnsupportedModelError, match=r"video.*drop --forkrl\.tree_packing"), h.cpu():
        t.ppo_train(0.0)
    after = h.parameters(t)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not _grads(t)
    policy = object.__new__(actors.TreePolicyModelActor)
    policy.actor, policy.trainer, policy.strategy = t.actor, t, t.strategy
    e = rounds[0][0]
    with pytest.raises(UnsupportedModelError, match="video"):
        policy.forward(e.sequences, e.action_mask, e.attention_mask, mm_train_inputs_list=[e.mm_train_inputs])


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--ds.packing_samples"], "drop --ds.packing_samples"),
        (["--forkrl.tree_mode", "packed"], "keep or replay mode"),
        (["--forkrl.tree_balance", "on", "--actor.num_gpus_per_node", "2"], "without their images"),
    ],
    ids=["packing-samples", "packed-mode", "balance-on"],
)
def test_vlm_setups_the_tree_cannot_serve_are_refused(extra, match):
    with pytest.raises(ValueError, match=match):
        h.trainer(_args(*extra), forkrl=True, model=_model(), vlm=True)


def test_vlm_ring_attention_and_dynamic_batching_are_refused():
    """Checked on the parsed arguments (a ring group needs several ranks to build)."""
    from forkrl.plugins.openrlhf.options import check_vlm_args, options_from

    for extra, match in (
        (["--ds.ring_attn_size", "2"], "--ds.ring_attn_size 1"),
        (["--train.dynamic_batch_enable", "--ds.zero_stage", "3"], "drop --train.dynamic_batch_enable"),
    ):
        args = _args(*extra)
        with pytest.raises(ValueError, match=match):
            check_vlm_args(args, options_from(args))


def test_an_unsupported_vision_language_family_is_refused():
    """A model the tree takes no images for, marked as OpenRLHF marks a VLM: refused at setup, the
    way out named."""
    with pytest.raises(UnsupportedModelError, match="train without --forkrl.tree_packing"):
        h.trainer(_args(), forkrl=True, vlm=True)


def _vlm_rank(stage: str) -> dict:
    """One rank of stock OpenRLHF and forkrl's trainer on this rank's images: the update's distance
    from stock's (relative to stock's change), whether rows were balanced, and, with video on rank 1
    only, the error each rank raised and whether its parameters and gradients stayed untouched."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mp = pytest.MonkeyPatch()
    args = _args("--actor.entropy_coef", "0.01", "--ds.zero_stage", stage)
    # The ranks' images differ; under ZeRO-2 rank 1's second round holds a text-only prompt (under
    # ZeRO-3 stock's own forward cannot take that: a rank without images skips the vision tower's
    # parameter fetches, which the other rank's collectives then mismatch).
    rounds = _rounds(args, mp, text_group=rank == 1 and stage == "2", seed=10 * rank)
    stock, _ = _train(args, tree=False, rounds=rounds)
    tree, status = _train(args, tree=True, rounds=rounds)
    before = {n: p.detach() for n, p in _model().named_parameters()}
    p_stock, p_tree = h.parameters(stock), h.parameters(tree)
    change = _distance(p_stock, before)
    rel = _distance(p_tree, p_stock) / change
    balanced = bool(tree.forkrl.host.balance)
    # Video on rank 1 only: both ranks stop before any gradient, neither waits in a collective.
    bad = _rounds(args, mp, seed=20 + 10 * rank)[0]
    if rank == 1:
        for e in bad:
            for mm in e.mm_train_inputs:
                mm["pixel_values_videos"], mm["video_grid_thw"] = (
                    torch.zeros(16, 1176),
                    torch.tensor([[1, 4, 4]]),
                )
    t = h.trainer(args, forkrl=True, model=_model(), vlm=True)
    start = h.parameters(t)
    h.fill(t, bad)
    try:
        with h.cpu():
            t.ppo_train(0.0)
        outcome = None
    except (UnsupportedModelError, RuntimeError) as err:
        outcome = type(err).__name__
    after = h.parameters(t)
    unchanged = all(torch.equal(start[n], after[n]) for n in start) and not _grads(t)
    return {"rel": rel, "change": change, "balanced": balanced, "refused": outcome, "unchanged": unchanged}


@pytest.mark.parametrize("stage", ["2", "3"], ids=["zero2", "zero3"])
def test_two_ranks_vlm_equal_stock_and_refuse_together(stage):
    """Two gloo ranks with different images (ZeRO-2: one with a text-only prompt): forkrl's update equals
    stock's on both, rows stay in place (``tree_balance auto``); video on one rank only is refused on
    both (the refusing rank's own error, the other's naming it), with nothing changed and no hang."""
    from forkrl.core.testing.ranks import run_on_ranks

    ranks = run_on_ranks(_vlm_rank, 2, stage)
    for rank, r in enumerate(ranks):
        assert r["rel"] < 5e-6 and r["change"] > 1e-2, r
        assert not r["balanced"], r
        assert r["refused"] == ("UnsupportedModelError" if rank == 1 else "RuntimeError"), r
        assert r["unchanged"], r
