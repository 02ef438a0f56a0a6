"""forkrl's ActorPPOTrainer against OpenRLHF's own, on identical experiences through the real
replay buffer, ppo_train, PolicyLoss/KL/entropy code and DeepSpeed ZeRO-2 engine: equal metrics and
equal parameters after several optimizer steps (SGD, float32, so the parameters see the update)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from forkrl.core.testing.models import byte_llama, byte_moe, max_rel_err
from forkrl.plugins.openrlhf import testing as h

# (name, extra OpenRLHF flags, per-token advantages)
CONFIGS = [
    ("grpo-token-mean", [], False),
    (
        "grpo-seq-mean-kl-entropy",
        ["--actor.loss_agg_mode", "seq-mean-token-mean", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
         "--algo.kl.init_coef", "0.05", "--actor.entropy_coef", "0.01"],
        False,
    ),
    (
        "ppo-token-advantages-kl-k2-dual-clip",
        ["--algo.kl.use_loss", "--algo.kl.estimator", "k2", "--algo.kl.init_coef", "0.05", "--actor.dual_clip", "3",
         "--actor.eps_clip_low_high", "0.1", "0.3"],
        True,
    ),
    ("gspo-seq-mean", ["--actor.policy_loss_type", "gspo", "--actor.loss_agg_mode", "seq-mean-token-mean"], False),
    ("kl-k1-unbiased-entropy-zero", ["--algo.kl.use_loss", "--algo.kl.unbiased_gradient", "--algo.kl.init_coef",
                                     "0.05", "--actor.entropy_coef", "0.0"], False),
    ("two-epochs-temperature", ["--train.max_epochs", "2", "--rollout.temperature", "0.7"], False),
    ("zero-stage-0", ["--ds.zero_stage", "0", "--actor.entropy_coef", "0.01"], False),
    ("zero-stage-3", ["--ds.zero_stage", "3", "--actor.entropy_coef", "0.01"], False),
    ("gradient-checkpointing-replay", ["--actor.gradient_checkpointing_enable", "--actor.entropy_coef", "0.01"], False),
    ("tree-mode-replay-block-5", ["--forkrl.tree_mode", "replay", "--forkrl.tree_block_size", "5"], False),
]  # fmt: skip


def _rounds(per_token: bool, n_rounds: int = 2):
    return [
        [h.experience(h.rollouts(seed=10 * r + k), seed=10 * r + k, per_token=per_token) for k in range(2)]
        for r in range(n_rounds)
    ]


@pytest.mark.parametrize("name,extra,per_token", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_tree_trainer_matches_stock(name, extra, per_token):
    argv = h.command("unused", *extra, "--forkrl.tree_packing")
    if "--ds.zero_stage" in extra:  # the extra one wins in argparse; keep the command line clean anyway
        i = argv.index("--ds.zero_stage")
        del argv[i : i + 2]
    args = h.parse_args(argv)
    rounds = _rounds(per_token)
    kl_ctl = 0.05 if "--algo.kl.use_loss" in extra else 0.0
    stock, s_status = h.train(args, rounds=rounds, forkrl=False, kl_ctl=kl_ctl)
    tree, t_status = h.train(args, rounds=rounds, forkrl=True, kl_ctl=kl_ctl)

    change, rel = h.agreement(stock, tree)
    assert change > 1e-2, "the update is too small to compare"
    assert rel < 1e-5, f"{name}: parameters differ by {rel:.2e} of the update"
    if "zero-stage-3" in name:  # the parameters really are partitions (the tiny model's too)
        from forkrl.core.train import is_zero3

        assert is_zero3(tree.actor.model.module) and is_zero3(stock.actor.model.module)
    for a, b in zip(s_status, t_status, strict=True):
        for key in (
            "policy_loss",
            "ppo_clip_ratio",
            "ppo_kl",
            "kl",
            "entropy_loss",
            "reward",
            "actor_grad_norm",
        ):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (name, key, a[key], b[key])
        assert b["tree/compression"] > 1.0
        assert b["tree/unique_tokens"] < b["tree/dense_tokens"]
        assert b["tree/mode"] == (1.0 if "replay" in name else 0.0)  # checkpointing runs the tree in replay


def test_packing_samples_is_accepted_and_exact():
    """``--ds.packing_samples`` only changes how stock OpenRLHF lays rows out for flash-attention
    varlen; the tree packs its own way. (The stock actor runs unpacked on the CPU: see forkrl.plugins.openrlhf.testing.)"""
    args = h.parse_args(
        h.command("unused", "--actor.entropy_coef", "0.01", "--ds.packing_samples", "--forkrl.tree_packing")
    )
    assert args.ds.packing_samples
    rounds = _rounds(False)
    stock, _ = h.train(args, rounds=rounds, forkrl=False, kl_ctl=0.0)
    tree, _ = h.train(args, rounds=rounds, forkrl=True, kl_ctl=0.0)
    change, rel = h.agreement(stock, tree)
    assert change > 1e-2 and rel < 1e-5, rel


def _moe():
    model = byte_moe("qwen3moe")
    model.config.output_router_logits = True  # as OpenRLHF's Actor sets it for a MoE checkpoint
    return model


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic-batch-zero-0"])
def test_moe_router_aux_loss_matches_stock(dynamic):
    """``--actor.aux_loss_coef``: the model's router load-balancing loss per micro-batch (scaled by
    the dynamic batch's loss scale) has the same gradient on the tree, and it is not negligible."""
    extra = ["--actor.aux_loss_coef", "0.5", "--actor.entropy_coef", "0.01"]
    if dynamic:
        extra += ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "40"]
    argv = h.command("unused", *extra, "--forkrl.tree_packing")
    argv[argv.index("--ds.zero_stage") + 1] = "0" if dynamic else "2"
    args = h.parse_args(argv)
    rounds = _rounds(False)
    stock, s_status = h.train(args, rounds=rounds, forkrl=False, kl_ctl=0.0, model=_moe)
    tree, t_status = h.train(args, rounds=rounds, forkrl=True, kl_ctl=0.0, model=_moe)
    change, rel = h.agreement(stock, tree, model=_moe)
    assert change > 1e-2 and rel < 1e-5, rel
    for a, b in zip(s_status, t_status, strict=True):
        assert abs(a["policy_loss"] - b["policy_loss"]) <= 1e-5 * max(1.0, abs(a["policy_loss"]))
    if not dynamic:  # the comparison can fail: without the router loss the update differs
        args.actor.aux_loss_coef = 0.0
        plain, _ = h.train(args, rounds=rounds, forkrl=False, kl_ctl=0.0, model=_moe)
        assert h.agreement(stock, plain, model=_moe)[1] > 1e-3


@pytest.mark.parametrize("stage", ["0", "3"])
def test_dynamic_batch_matches_stock(stage):
    """Dynamic batching: windows end where the buffer's dynamic_optimizer_step says, loss
    normalisers come from the buffer, DeepSpeed's accumulation is 1 (stages 0 and 3: gradients
    accumulate across the window's backwards, as in stock)."""
    extra = [
        "--train.dynamic_batch_enable",
        "--train.max_tokens_per_gpu",
        "40",
        "--actor.entropy_coef",
        "0.01",
    ]
    argv = h.command("unused", *extra, "--forkrl.tree_packing")
    argv[argv.index("--ds.zero_stage") + 1] = stage
    args = h.parse_args(argv)
    rounds = _rounds(False)
    stock, s_status = h.train(args, rounds=rounds, forkrl=False, kl_ctl=0.0)
    tree, t_status = h.train(args, rounds=rounds, forkrl=True, kl_ctl=0.0)
    change, rel = h.agreement(stock, tree)
    assert change > 1e-2 and rel < 1e-5, rel
    for a, b in zip(s_status, t_status, strict=True):
        assert abs(a["policy_loss"] - b["policy_loss"]) <= 1e-5 * max(1.0, abs(a["policy_loss"]))


def test_scoring_matches_actor_forward():
    """Old/reference log-probs: the tree scorer equals OpenRLHF's Actor.forward, masked alike."""
    from forkrl.plugins.openrlhf.trainer import score_log_probs, tree_module

    args = h.parse_args(h.command("unused", "--rollout.temperature", "0.8", "--forkrl.tree_packing"))
    t = h.trainer(args, forkrl=True)
    e = h.experience(h.rollouts(seed=3), seed=3)
    with torch.no_grad():
        want = t.actor(e.sequences, e.action_mask, e.attention_mask)
    got = score_log_probs(t.tree_step, tree_module(t.actor), e.sequences, e.action_mask, e.attention_mask)
    assert got.shape == want.shape
    assert max_rel_err(got, want) < 1e-5
    assert (got[~e.action_mask] == 0).all()


def test_training_step_outside_a_window_is_refused_before_any_change():
    args = h.parse_args(h.command("unused", "--forkrl.tree_packing"))
    t = h.trainer(args, forkrl=True)
    before = h.parameters(t)
    e = h.experience(h.rollouts(seed=4), seed=4)
    with pytest.raises(RuntimeError, match="outside ppo_train's optimizer-step windows"), h.cpu():
        t.training_step(e, 0.0, 0, None)
    after = h.parameters(t)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(p.grad is None for p in t.actor.model.module.parameters())


def test_without_forkrl_flags_the_trainer_is_stock():
    args = h.parse_args(h.command("unused"))
    assert args.forkrl.tree_packing is False
    t = h.trainer(args, forkrl=True)
    assert t.tree_step is None


def test_deepspeed_zero2_keeps_only_the_last_backward_without_accumulation():
    """The upstream fact behind refusing dynamic batching on ZeRO-1/2 (OpenRLHF sets DeepSpeed's
    gradient_accumulation_steps=1 there and steps once per window): two backwards, then a step,
    apply only the second's gradient (stages 0 and 3 apply both). If DeepSpeed changes this, revisit
    the refusal in forkrl.plugins.openrlhf.options.check_host_args."""
    import deepspeed

    updates = {}
    for stage in (0, 2, 3):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 1, bias=False)
        w0 = m.weight.detach().clone()
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
        }
        engine, *_ = deepspeed.initialize(
            model=m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0), config=config
        )
        for x in (torch.tensor([[1.0, 0, 0, 0]]), torch.tensor([[0.0, 1, 0, 0]])):
            engine.backward(engine(x).sum())
        engine.step()
        with deepspeed.zero.GatheredParameters([m.weight], modifier_rank=None):
            updates[stage] = (w0 - m.weight.detach()).flatten().tolist()
    assert updates[0] == pytest.approx([1.0, 1.0, 0.0, 0.0], abs=1e-5)
    assert updates[2] == pytest.approx([0.0, 1.0, 0.0, 0.0], abs=1e-5)
    assert updates[3] == pytest.approx([1.0, 1.0, 0.0, 0.0], abs=1e-5)


@pytest.mark.parametrize("stage", ["2", "3"])
def test_policy_and_reference_actors_tree_score_like_openrlhf(stage):
    """forkrl's Ray actor classes (their forward, as Ray runs it in the worker) against OpenRLHF's:
    old-policy log-probs from the policy actor, reference log-probs from the reference actor. Under
    ZeRO-3 the tree scorer gathers the partitions once per call and leaves them partitioned."""
    from openrlhf.trainer.ray.launcher import ReferenceModelActor
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    from forkrl.core.train import is_zero3
    from forkrl.plugins.openrlhf import actors

    argv = h.command("unused", "--rollout.temperature", "0.9", "--forkrl.tree_packing")
    argv[argv.index("--ds.zero_stage") + 1] = stage
    t = h.trainer(h.parse_args(argv), forkrl=True)
    module = t.actor.model.module
    assert is_zero3(module) == (stage == "3")
    e = h.experience(h.rollouts(seed=5), seed=5)
    inputs = (e.sequences, e.action_mask, e.attention_mask)

    policy, reference = partial(h.policy_actor, t), partial(h.reference_actor, t)

    with h.cpu():
        for host, ours in (
            (policy(PolicyModelActor.__ray_actor_class__), policy(actors.TreePolicyModelActor)),
            (reference(ReferenceModelActor.__ray_actor_class__), reference(actors.TreeReferenceModelActor)),
        ):
            want, got = host.forward(*inputs), ours.forward(*inputs)
            assert got.device.type == "cpu" and got.shape == want.shape
            assert max_rel_err([got], [want]) < 1e-5
            assert all(p.numel() == 0 for p in module.parameters()) == (stage == "3")  # partitioned again
    # Without tree training the actors are OpenRLHF's (no tree scorer is used).
    plain = reference(actors.TreeReferenceModelActor)
    plain.tree_step = None
    with h.cpu():
        assert torch.equal(
            plain.forward(*inputs), reference(ReferenceModelActor.__ray_actor_class__).forward(*inputs)
        )


@pytest.mark.parametrize("stage", ["2", "3"])
def test_bf16_tree_is_within_bf16_rounding_of_stock(stage):
    """DeepSpeed's bf16 mode (OpenRLHF's default dtype), ZeRO-2 and ZeRO-3: forkrl's parameters after 4
    optimizer steps are within half of stock bf16's distance to stock float32 (measured 0.31 of it at
    ZeRO-2 and ZeRO-3), i.e. within bf16's own rounding noise."""
    argv = h.command("unused", "--actor.entropy_coef", "0.01", "--forkrl.tree_packing")
    i = argv.index("--ds.zero_stage")
    argv[i + 1] = stage
    args = h.parse_args(argv)
    rounds = _rounds(False)

    def run(tree: bool, bf16: bool) -> dict[str, torch.Tensor]:
        t = h.trainer(args, forkrl=tree, bf16=bf16)
        for experiences in rounds:
            h.fill(t, experiences)
            torch.manual_seed(123)
            with h.cpu():
                t.ppo_train(0.0)
            t.replay_buffer.clear()
        return {n: p.float() for n, p in h.parameters(t).items()}

    exact, stock, tree = run(False, False), run(False, True), run(True, True)
    before = {n: p.detach().to(torch.bfloat16).float() for n, p in byte_llama(0).named_parameters()}

    def dist(a, b):
        return float(torch.cat([(a[n] - b[n]).flatten() for n in a]).norm())

    change = dist(stock, before)
    assert change > 1e-2
    assert dist(tree, stock) < 0.5 * dist(stock, exact), (
        dist(tree, stock) / change,
        dist(stock, exact) / change,
    )


def test_experience_maker_text_samples_are_tree_scored(monkeypatch):
    """OpenRLHF's own experience maker on text samples as its samples generator builds them
    (``mm_train_inputs=[None]`` per sample, so ``make_experience`` passes ``mm_train_inputs_list``
    to every actor ``forward``): the policy's and the reference's log-probs are tree-scored (the
    actors fell back to stock whenever the argument was present) and equal OpenRLHF's own actors'."""
    from types import SimpleNamespace

    from openrlhf.trainer.ppo_utils import experience_maker
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ray.launcher import ReferenceModelActor
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    from forkrl.core import TreeStep
    from forkrl.plugins.openrlhf import actors

    t = h.trainer(h.parse_args(h.command("unused", "--forkrl.tree_packing")), forkrl=True)
    samples = []  # as SamplesGenerator builds one Experience per response (samples_generator.py)
    for p, r in h.rollouts(seed=6):
        ids = torch.tensor([p + r])
        samples.append(
            Experience(
                sequences=ids, attention_mask=torch.ones_like(ids), action_mask=torch.tensor([[1] * len(r)]).bool(),
                prompts=["q"], labels=[""], images=[None], mm_train_inputs=[None], rewards=torch.tensor([0.5]),
                response_length=torch.tensor([len(r)]), truncated=torch.tensor([False]),
                total_length=torch.tensor([len(p) + len(r)]), info={},
            )
        )  # fmt: skip
    batches = [Experience.concat_experiences(samples[i : i + 4], 0) for i in range(0, len(samples), 4)]

    policy, reference = partial(h.policy_actor, t), partial(h.reference_actor, t)

    class Group:  # one in-process actor for the Ray group: its method per micro-batch, as the workers run it
        def __init__(self, actor):
            self.actor = actor

        def async_run_method_batch(self, method_name, **kwargs):
            calls = [dict(zip(kwargs, values, strict=True)) for values in zip(*kwargs.values(), strict=True)]
            return [[getattr(self.actor, method_name)(**c) for c in calls]]

    scored = []
    real = TreeStep.score_window
    monkeypatch.setattr(
        TreeStep, "score_window", lambda self, *a, **k: scored.append(1) or real(self, *a, **k)
    )
    monkeypatch.setattr(experience_maker, "ray", SimpleNamespace(put=lambda x: x, get=lambda x: x))

    def make(policy_cls, reference_cls):
        maker = object.__new__(experience_maker.RemoteExperienceMaker)
        maker.strategy, maker.args = t.strategy, t.strategy.args
        maker.actor_model_group, maker.initial_model_group = (
            Group(policy(policy_cls)),
            Group(reference(reference_cls)),
        )
        maker.critic_model_group = maker.reward_model_group = None
        with h.cpu():
            return maker.make_experience([h._copy(b) for b in batches])

    ours = make(actors.TreePolicyModelActor, actors.TreeReferenceModelActor)
    assert len(scored) == 2 * len(batches)  # every micro-batch, policy and reference, through the tree
    stock = make(PolicyModelActor.__ray_actor_class__, ReferenceModelActor.__ray_actor_class__)
    assert len(scored) == 2 * len(batches)
    for a, b in zip(ours, stock, strict=True):
        assert max_rel_err([a.action_log_probs], [b.action_log_probs]) < 1e-5
        assert max_rel_err([a.kl], [b.kl]) < 1e-3 * max(1.0, float(b.kl.abs().max()))


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> str:
    return h.save_model(tmp_path_factory.mktemp("byte-llama"))


@pytest.mark.parametrize(
    "stage,targets",
    [("2", []), ("3", ["--ds.lora.target_modules", "q_proj", "v_proj", "down_proj"])],
    ids=["zero-2-all-linear", "zero-3-some-modules"],
)
def test_lora_policy_matches_stock(saved_model, stage, targets):
    """``--ds.lora.rank/alpha/target_modules``: OpenRLHF's ``Actor`` wraps the model with peft's
    ``get_peft_model`` (``all-linear`` by default); the tree trains the adapters of that PeftModel
    inside DeepSpeed's engine, the base weights frozen, to stock's parameters after two steps
    (measured 4e-7 and 5e-7 of the update)."""
    extra = ["--ds.lora.rank", "4", "--ds.lora.alpha", "8", *targets, "--actor.entropy_coef", "0.01"]
    argv = h.command("unused", *extra, "--forkrl.tree_packing")
    argv[argv.index("--ds.zero_stage") + 1] = stage
    args = h.parse_args(argv)
    model = partial(h.lora_model, saved_model, args)
    rounds = _rounds(False)
    stock, s_status = h.train(args, rounds=rounds, forkrl=False, kl_ctl=0.0, model=model)
    tree, t_status = h.train(args, rounds=rounds, forkrl=True, kl_ctl=0.0, model=model)
    module = tree.actor.model.module
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    assert type(module).__name__ == "PeftModelForCausalLM" and trained and all("lora_" in n for n in trained)
    if targets:
        assert {n.split(".")[-4] for n in trained} == {"q_proj", "v_proj", "down_proj"}
    change, rel = h.agreement(stock, tree, model=model)
    assert change > 1e-2 and rel < 1e-5, (change, rel)
    for a, b in zip(s_status, t_status, strict=True):
        assert abs(a["policy_loss"] - b["policy_loss"]) <= 1e-5 * max(1.0, abs(a["policy_loss"]))
        assert b["tree/compression"] > 1.0
    # old-policy log-probs of the trained adapters: the tree scorer as the Actor's own forward
    from forkrl.plugins.openrlhf.trainer import score_log_probs, tree_module

    e = h.experience(h.rollouts(seed=3), seed=3)
    with torch.no_grad():
        want = tree.actor(e.sequences, e.action_mask, e.attention_mask)
    got = score_log_probs(
        tree.tree_step, tree_module(tree.actor), e.sequences, e.action_mask, e.attention_mask
    )
    assert max_rel_err([got], [want]) < 1e-5
