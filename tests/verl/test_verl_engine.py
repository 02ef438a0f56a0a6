"""forkrl's veRL engine against veRL's own FSDP2 engine, both built by veRL's real TrainingWorker.

Every configuration trains the stock engine and forkrl's from the same weights on the same
batches (groups sharing prompts, responses of varying lengths that extend or repeat one another)
for two ``update_actor`` calls with SGD, and asserts the parameters agree to 1e-4 of the update
(float32, observed ~1e-6) and veRL's loss metric agrees; old log-probs and entropies from
``compute_log_prob`` agree to float tolerance. Runs in the veRL environment (.venv-verl).
"""

from __future__ import annotations

import math

import pytest
import torch

from forkrl.core.testing.stock import assert_equals_stock
from forkrl.plugins.verl import testing as h

TOL = 1e-4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return h.save_model(tmp_path_factory.mktemp("verl-tiny"))


def _pair(model_path, forkrl=None, use_remove_padding=True, max_token_len=None, **actor):
    stock = h.worker(
        model_path, h.actor_config(None, **actor), use_remove_padding, max_token_len=max_token_len
    )
    tree = h.worker(
        model_path,
        h.actor_config(forkrl or {"tree_packing": True}, **actor),
        use_remove_padding,
        max_token_len=max_token_len,
    )
    assert (
        type(tree.engine).__name__ == "TreeFSDPEngineWithLMHead"
        and type(stock.engine).__name__ == "FSDPEngineWithLMHead"
    )
    return stock, tree


def _train_both(stock, tree, steps=2, entropy=True, kl=False, is_weights=False, rollouts=None, mini_batch=8):
    rollouts = rollouts or h.rows()
    init = h.parameters(stock)
    run = dict(steps=steps, mini_batch=mini_batch, entropy=entropy, kl=kl, is_weights=is_weights)
    logs = list(zip(h.train(stock, rollouts, **run), h.train(tree, rollouts, **run), strict=True))
    return init, logs


CONFIGS = {
    "vanilla-token-mean": {},
    "seq-mean-token-sum": dict(loss_agg_mode="seq-mean-token-sum"),
    "seq-mean-token-mean": dict(loss_agg_mode="seq-mean-token-mean"),
    "seq-mean-token-sum-norm": dict(loss_agg_mode="seq-mean-token-sum-norm"),
    "token-sum": dict(loss_agg_mode="token-sum"),
    "gspo": dict(policy_loss={"loss_mode": "gspo"}, loss_agg_mode="seq-mean-token-mean"),
    "gpg": dict(policy_loss={"loss_mode": "gpg"}),
    "clip-cov": dict(policy_loss={"loss_mode": "clip_cov"}),
    "kl-cov": dict(policy_loss={"loss_mode": "kl_cov"}),
    "cispo": dict(policy_loss={"loss_mode": "cispo"}),
    "sapo": dict(policy_loss={"loss_mode": "sapo"}),
    "geo-mean": dict(policy_loss={"loss_mode": "geo_mean"}),
    "dppo-tv": dict(policy_loss={"loss_mode": "dppo_tv"}),
    "dppo-kl": dict(policy_loss={"loss_mode": "dppo_kl"}),
    "dro": dict(policy_loss={"loss_mode": "dro", "dro_beta": 0.1}),
    "dual-clip": dict(clip_ratio_c=2.0, clip_ratio_low=0.1, clip_ratio_high=0.3),
    "entropy-bonus": dict(entropy_coeff=0.01),
    "kl-loss": dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl"),
    "kl-loss-k1": dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1"),
    # veRL's own flag, read by neither its engine nor its v1 trainer (compat._prefix_grouper)
    "prefix-grouper": dict(use_prefix_grouper=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tree_engine_equals_stock(name, model_path):
    actor = dict(CONFIGS[name])
    if "policy_loss" in actor:
        from verl.workers.config import PolicyLossConfig

        actor["policy_loss"] = PolicyLossConfig(**actor["policy_loss"])
    stock, tree = _pair(model_path, **actor)
    kl = actor.get("use_kl_loss", False)
    init, logs = _train_both(
        stock, tree, entropy=actor.get("entropy_coeff", 0.0) != 0.0 or name == "vanilla-token-mean", kl=kl
    )
    assert_equals_stock(h.parameters(stock), h.parameters(tree), init, TOL, what="forkrl's engine")
    for ms, mt in logs:
        assert math.isclose(ms["loss"][0], mt["loss"][0], rel_tol=1e-4, abs_tol=1e-6), (
            ms["loss"],
            mt["loss"],
        )
        assert mt["tree/compression"][0] > 1.0
        assert mt["tree/mode"][0] == 0  # auto keeps without veRL's gradient checkpointing


def test_gradient_checkpointing_makes_auto_replay(model_path):
    """veRL's ``model.enable_gradient_checkpointing`` (on in its default config): ``tree_mode: auto``
    trains in replay mode (its own checkpointing), and the update is still stock's."""
    stock = h.worker(model_path, h.actor_config(None), gradient_checkpointing=True)
    tree = h.worker(model_path, h.actor_config({"tree_packing": True}), gradient_checkpointing=True)
    init, logs = _train_both(stock, tree)
    assert_equals_stock(h.parameters(stock), h.parameters(tree), init, TOL)
    assert all(mt["tree/mode"][0] == 1 for _, mt in logs)


def test_lora_is_refused_before_the_model_is_built(model_path):
    """LoRA policies are refused on the driver (``test_verl_yaml``); a worker built without the
    driver's check refuses them when the engine is made, before any model exists."""
    with pytest.raises(
        ValueError, match=r"does not train LoRA policies \(actor_rollout_ref.model.lora_rank=8\)"
    ):
        h.worker(model_path, h.actor_config({"tree_packing": True}), lora_rank=8, lora_alpha=16)


def _multi_turn_rollouts(seed: int = 0) -> tuple[list, list]:
    """Two GRPO groups of tool-calling trajectories as veRL's agent loop returns them
    (``AgentLoopOutput``: the prompt, then the model's turns interleaved with tool outputs in one
    response, ``response_mask`` 1 on the model's tokens and 0 on the tool's), converted by its own
    ``as_dict``. In each group two trajectories share their first call and its tool output (a
    three-level tree), one makes two calls, one answers without a tool."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 250, (n,), generator=g).tolist()

    rollouts, masks = [], []
    for group in range(2):
        prompt, call, tool = tokens(9 + group), tokens(4), tokens(5)
        trajectories = [  # (tokens, response_mask value): the model's turns 1, the tool's 0
            [(call, 1), (tool, 0), (tokens(3), 1)],
            [(call, 1), (tool, 0), (tokens(5), 1)],
            [(call, 1), (tokens(4), 0), (tokens(3), 1), (tokens(4), 0), (tokens(2), 1)],
            [(tokens(6), 1)],
        ]
        for turns in trajectories:
            out = AgentLoopOutput(
                prompt_ids=prompt,
                response_ids=[t for seg, _ in turns for t in seg],
                response_mask=[m for seg, m in turns for _ in seg],
                num_turns=1 + len(turns),
                metrics=AgentLoopMetrics(),
            ).as_dict()
            rollouts.append((out["prompts"].tolist(), out["responses"].tolist()))
            masks.append(out["response_mask"].tolist())
    return rollouts, masks


def test_multi_turn_tool_trajectories_equal_stock(model_path):
    """veRL's multi-turn agent loop's rows (tool outputs inside the response, masked out of the
    loss): old log-probs and two updates with the KL loss equal stock's, and the tree shares the
    trajectories' common turns."""
    actor = dict(use_kl_loss=True, kl_loss_coef=0.1)
    stock, tree = _pair(model_path, **actor)
    init = h.parameters(stock)
    for step in range(2):
        rollouts, masks = _multi_turn_rollouts(step)
        assert any(0 in m for m in masks)
        td = h.batch(rollouts, seed=step, kl=True, response_masks=masks)
        lp_s, _, _ = h.log_probs(stock, td)
        lp_t, _, _ = h.log_probs(tree, td)
        torch.testing.assert_close(lp_t, lp_s, rtol=1e-5, atol=2e-6)
        ms, mt = h.update(stock, td, 8, True), h.update(tree, td, 8, True)
        assert math.isclose(ms["loss"][0], mt["loss"][0], rel_tol=1e-4, abs_tol=1e-6)
        assert mt["tree/compression"][0] > 1.0
    assert_equals_stock(h.parameters(stock), h.parameters(tree), init, TOL)


def test_text_rows_of_the_v1_agent_loop_train_and_score(model_path):
    """veRL's v1 agent loop (main_ppo's default path) writes ``multi_modal_inputs`` for every row, an
    empty dict for text: the tree engine trains and scores such batches like stock (it refused every
    text run when it looked at the key instead of its content), and still refuses real images."""
    stock, tree = _pair(model_path)
    rollouts = h.rows()
    init = h.parameters(stock)
    for step in range(2):
        td = h.agent_loop_fields(h.batch(rollouts, seed=step), rollouts)
        lp_s, _, _ = h.log_probs(stock, td)
        lp_t, _, _ = h.log_probs(tree, td)
        torch.testing.assert_close(lp_t, lp_s, rtol=1e-5, atol=2e-6)
        h.update(stock, td, 8, True), h.update(tree, td, 8, True)
    assert_equals_stock(h.parameters(stock), h.parameters(tree), init, TOL)
    td = h.agent_loop_fields(h.batch(rollouts), rollouts)
    from verl.utils import tensordict_utils as tu

    rows = [{} for _ in rollouts]
    rows[3] = {"pixel_values": torch.zeros(4, 8)}
    tu.assign_non_tensor_stack(td, "multi_modal_inputs", rows)
    with pytest.raises(ValueError, match="multi-modal inputs"):
        h.update(tree, td, 8, True)


def test_rollout_importance_weights(model_path):
    stock, tree = _pair(model_path)
    init, _ = _train_both(stock, tree, is_weights=True)
    assert_equals_stock(h.parameters(stock), h.parameters(tree), init, TOL)


def test_without_remove_padding(model_path):
    stock, tree = _pair(model_path, use_remove_padding=False)
    init, _ = _train_both(stock, tree)
    assert_equals_stock(h.parameters(stock), h.parameters(tree), init, TOL)


def test_dynamic_batch_size(model_path):
    """Dynamic batch size: veRL regroups rows into micro-batches by token budget (and reorders the
    outputs back); forkrl keeps that partition and that order."""
    stock, tree = _pair(model_path, max_token_len=48, use_dynamic_bsz=True)
    init, _ = _train_both(stock, tree)
    assert_equals_stock(h.parameters(stock), h.parameters(tree), init, TOL)
    td = h.batch(h.rows(seed=3))
    lp_s, ent_s, _ = h.log_probs(stock, td)
    lp_t, ent_t, _ = h.log_probs(tree, td)
    torch.testing.assert_close(lp_t, lp_s, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("tree_mode", ["keep", "replay"])
def test_old_log_probs_and_entropies_equal_stock(tree_mode, model_path):
    forkrl = {"tree_packing": True, "tree_mode": tree_mode}
    if tree_mode == "replay":
        forkrl["tree_block_size"] = 5
    stock, tree = _pair(model_path, forkrl=forkrl)
    td = h.batch(h.rows(seed=1))
    lp_s, ent_s, _ = h.log_probs(stock, td, temperature=0.7)
    lp_t, ent_t, _ = h.log_probs(tree, td, temperature=0.7)
    torch.testing.assert_close(lp_t, lp_s, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(ent_t, ent_s, rtol=1e-5, atol=2e-5)


def test_long_context_replay_trains_like_stock(model_path):
    stock, tree = _pair(model_path, forkrl={"long_context_replay": True, "tree_block_size": 4})
    init, _ = _train_both(stock, tree)
    assert_equals_stock(h.parameters(stock), h.parameters(tree), init, TOL)


def test_tree_off_is_stock(model_path):
    stock = h.worker(model_path, h.actor_config(None))
    off = h.worker(model_path, h.actor_config({"tree_packing": False}))
    assert type(off.engine).__name__ == "FSDPEngineWithLMHead"  # veRL's own engine, untouched
    init, _ = _train_both(stock, off)
    a, b = h.parameters(off), h.parameters(stock)
    assert all(torch.equal(a[n], b[n]) for n in b)


def test_config_errors():
    with pytest.raises(ValueError, match=r"unknown forkrl option\(s\) \['tree_packnig'\]"):
        h.actor_config({"tree_packnig": True})
    with pytest.raises(ValueError, match="tree_mode='fast' is not one of"):
        h.actor_config({"tree_packing": True, "tree_mode": "fast"})
    sp = h.actor_config(
        {"tree_packing": True}, ulysses_sequence_parallel_size=2
    )  # accepted (test_verl_ulysses)
    assert sp.engine.ulysses_sequence_parallel_size == 2
    with pytest.raises(ValueError, match="a Ulysses group .* does not do: its ranks share"):
        h.actor_config({"tree_packing": True, "tree_balance": "on"}, ulysses_sequence_parallel_size=2)
    from verl.workers.config.actor import PolicyLossConfig

    on = {"tree_packing": True, "tree_balance": "on"}
    assert h.actor_config(on).engine.forkrl_balance_unsafe is None  # veRL's default loss: rows may move
    with pytest.raises(
        ValueError, match="tree_balance: on would change veRL's update: policy_loss.loss_mode='clip_cov'"
    ):
        h.actor_config(on, policy_loss=PolicyLossConfig(loss_mode="clip_cov"))
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm' without loss_scale_factor"):
        h.actor_config(on, loss_agg_mode="seq-mean-token-sum-norm")
    h.actor_config(on, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=512)  # a fixed width: exact
    auto = h.actor_config({"tree_packing": True}, policy_loss=PolicyLossConfig(loss_mode="geo_mean"))
    assert "geo_mean" in auto.engine.forkrl_balance_unsafe  # auto: the rows stay where veRL put them


def test_per_sample_temperatures_are_refused(model_path):
    stock, tree = _pair(model_path)
    td = h.batch(h.rows())
    from verl.utils import tensordict_utils as tu

    td = td.clone()
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
    td["temperature"] = torch.linspace(0.5, 1.0, td.batch_size[0])
    with pytest.raises(ValueError, match="one temperature per mini-batch"):
        tree.infer_batch(td)


@pytest.mark.parametrize("name", ["deepseekv3", "kimik2"])
def test_multi_head_latent_attention_models_equal_stock(name, tmp_path):
    """DeepSeek-V3- and Kimi-K2-shaped models (MLA + MoE) through veRL's engine: the update equals
    stock's (this environment's transformers caches MLA's expanded keys: the tree runs the model's
    own attention over them)."""
    from forkrl.core.testing.models import byte_model, byte_tokenizer, save_pretrained

    path = save_pretrained(byte_model(name), byte_tokenizer(), tmp_path / name)
    stock, tree = _pair(path)
    init, logs = _train_both(stock, tree)
    assert_equals_stock(h.parameters(stock), h.parameters(tree), init, TOL, what=f"forkrl's engine on {name}")
    assert all(mt["tree/compression"][0] > 1.0 for _, mt in logs)
