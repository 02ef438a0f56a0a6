"""forkrl's TRL plugin against stock ``trl.GRPOTrainer`` on identical rollouts (real TRL, tiny Llama).

Every configuration trains stock TRL and the plugin for three optimizer steps (SGD, so the update
is linear in the gradient) from the same weights on the same deterministic rollouts, and asserts
the final parameters agree to 1e-4 of the parameter change (float32; observed ~1e-6), and that
TRL's logged losses and metrics agree.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from forkrl.core.testing.ranks import run_in_subprocess, run_on_ranks
from forkrl.core.testing.stock import assert_equals_stock

trl = pytest.importorskip("trl")

from forkrl.plugins import trl as ftrl  # noqa: E402

from .trl_helpers import (  # noqa: E402
    base_args,
    initial_params,
    letter_reward,
    make_rollout_func,
    prompt_dataset,
    save_tiny_llama,
    train,
    train_rloo,
)

TOL = 1e-4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def init(model_path):
    return initial_params(model_path)


def _logged(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_same_run(stock, tree, init, stock_trainer, tree_trainer, tol: float = TOL) -> None:
    assert_equals_stock(stock, tree, init, tol, what="the plugin")
    a, b = _logged(stock_trainer), _logged(tree_trainer)
    assert len(a) == len(b) > 0
    for ha, hb in zip(a, b, strict=True):
        for key in ("loss", "entropy", "kl", "clip_ratio/region_mean", "cispo_clip_ratio", "entropy_coef"):
            if key in ha:
                assert math.isclose(ha[key], hb[key], rel_tol=1e-4, abs_tol=1e-6), (key, ha[key], hb[key])
        assert hb["tree/compression"] > 1.0


CONFIGS = {
    "dapo-default": {},
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "cispo": dict(loss_type="cispo"),
    "sapo": dict(loss_type="sapo"),
    "luspo-sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "grpo-sequence-level": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "dapo-delta": dict(delta=1.5),
    "beta-ref-model": dict(beta=0.1),
    "top-entropy-quantile": dict(top_entropy_quantile=0.5),
    "entropy-bonus": dict(entropy_coef=0.01),
    "adaptive-entropy": dict(use_adaptive_entropy=True, entropy_target=9.0),
    "num-iterations-2": dict(num_iterations=2),
    "steps-per-generation-4": dict(steps_per_generation=4),
    "num-iterations-2-grpo-sequence": dict(
        num_iterations=2, loss_type="grpo", importance_sampling_level="sequence"
    ),
    "num-iterations-2-beta-bias-kl": dict(num_iterations=2, beta=0.05, use_bias_correction_kl=True),
    "off-policy-mask": dict(num_iterations=2, off_policy_mask_threshold=0.0),
    "replay-blocks": dict(tree_mode="replay", tree_block_size=5),
    "packed": dict(tree_mode="packed"),
    "gradient-checkpointing": dict(gradient_checkpointing=True),
    "long-context-replay": dict(long_context_replay=True, tree_packing=False, tree_block_size=7),
    # TRL compiles the model at train(); the tree runs the module under the compiled wrapper
    "torch-compile": dict(torch_compile=True, torch_compile_backend="eager"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_plugin_equals_stock(name, model_path, init, tmp_path):
    cfg = CONFIGS[name]
    stock_cfg = {k: v for k, v in cfg.items() if not (k.startswith("tree_") or k.startswith("long_context"))}
    stock, st = train(model_path, tmp_path / "stock", False, **stock_cfg)
    tree, tt = train(model_path, tmp_path / "tree", True, **cfg)
    assert_same_run(stock, tree, init, st, tt)


def test_tool_mask_and_truncated_completions(model_path, init, tmp_path):
    cfg = dict(mask_truncated_completions=True, max_completion_length=16)
    rollout = make_rollout_func(tool_mask=True, truncate_some=True)
    stock, st = train(model_path, tmp_path / "stock", False, rollout=rollout, **cfg)
    tree, tt = train(model_path, tmp_path / "tree", True, rollout=rollout, **cfg)
    assert_same_run(stock, tree, init, st, tt)


def test_peft_adapter_as_reference(model_path, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM"
    )
    start: dict[str, torch.Tensor] = {}

    def remember(trainer):
        start.update({n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad})

    stock, st = train(model_path, tmp_path / "s", False, peft_config=lora, beta=0.1, trainer_hook=remember)
    tree, tt = train(model_path, tmp_path / "t", True, peft_config=lora, beta=0.1)
    assert stock and all("lora" in n for n in stock)
    assert_equals_stock(stock, tree, start, TOL)
    assert _logged(tt)[-1]["kl"] > 0


def _vllm_correction_inputs(trainer) -> None:
    # No vLLM server on a CPU: switch TRL's importance-sampling correction on after init, with the
    # rollout's sampling log-probs standing in for vLLM's; the weight-sync call is the only engine use.
    trainer.use_vllm = True
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)
    trainer._last_loaded_step = -1


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_vllm_importance_sampling_inputs(mode, model_path, init, tmp_path):
    base = make_rollout_func()

    def rollout(prompts, trainer):
        out = base(prompts, trainer)
        out["logprobs"] = [[-5.6 + 0.05 * (j % 5) for j in range(len(c))] for c in out["completion_ids"]]
        return out

    cfg = dict(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.5)
    stock, st = train(
        model_path, tmp_path / "s", False, rollout=rollout, trainer_hook=_vllm_correction_inputs, **cfg
    )
    tree, tt = train(
        model_path, tmp_path / "t", True, rollout=rollout, trainer_hook=_vllm_correction_inputs, **cfg
    )
    assert "sampling/importance_sampling_ratio/mean" in _logged(tt)[-1]
    assert_same_run(stock, tree, init, st, tt)


def test_tree_packing_off_is_stock(model_path, tmp_path):
    stock, _ = train(model_path, tmp_path / "stock", False)
    args = ftrl.GRPOConfig(**base_args(tmp_path / "plugin"))
    plugin = ftrl.GRPOTrainer(
        model=model_path,
        reward_funcs=letter_reward,
        args=args,
        train_dataset=prompt_dataset(),
        rollout_func=make_rollout_func(),
    )
    plugin.train()
    for name, p in plugin.model.named_parameters():
        assert torch.equal(p.detach(), stock[name]), name
    assert not any(k.startswith("tree/") for h in plugin.state.log_history for k in h)


def test_keyword_shortcut_and_metrics(model_path, tmp_path):
    stock_args = trl.GRPOConfig(**base_args(tmp_path / "kw"))
    trainer = ftrl.GRPOTrainer(
        model_path,
        letter_reward,
        stock_args,
        train_dataset=prompt_dataset(),
        rollout_func=make_rollout_func(),
        tree_packing=True,
        tree_mode="keep",
    )
    assert isinstance(trainer.args, ftrl.GRPOConfig) and trainer.args.tree_packing
    assert not hasattr(stock_args, "tree_packing")  # the user's config is copied, not changed
    trainer.train()
    last = _logged(trainer)[-1]
    for key in (
        "tree/compression",
        "tree/unique_tokens",
        "tree/dense_tokens",
        "tree/mode",
        "tree/backward_time",
    ):
        assert key in last
    assert last["tree/dense_tokens"] > last["tree/unique_tokens"] > 0
    assert last["tree/mode"] == 0.0
    with pytest.raises(TypeError, match="unknown forkrl option"):
        ftrl.GRPOConfig.from_trl(stock_args, tree_packnig=True)


def test_fused_pass_only_when_gradient_is_value_independent(model_path, tmp_path):
    _, default = train(model_path, tmp_path / "a", True, max_steps=1)
    assert default.forkrl.tree().fused_ok and _logged(default)[-1]["tree/score_time"] == 0.0
    _, beta = train(model_path, tmp_path / "b", True, max_steps=1, beta=0.1)
    assert _logged(beta)[-1]["tree/score_time"] > 0.0  # KL reads the log-probs: scoring pass first


def test_fused_probe_catches_value_dependent_loss(model_path, init, tmp_path, monkeypatch):
    # Negative control: claim the coefficients are constant when they are not (beta > 0 makes the
    # KL term read the log-probs). The two-point probe must notice and fall back to the scoring pass.
    monkeypatch.setattr(ftrl.GRPOTrainer, "_coefficients_constant", lambda self, window: True)
    stock, st = train(model_path, tmp_path / "s", False, beta=0.5)
    tree, tt = train(model_path, tmp_path / "t", True, beta=0.5)
    assert not tt.forkrl.tree().fused_ok
    assert_same_run(stock, tree, init, st, tt)


@pytest.mark.slow
def test_reward_rises_end_to_end(tmp_path):
    """Real TRL generation (no rollout_func) on a learnable task: reward for emitting 'a'..'e'."""
    path = save_tiny_llama(tmp_path / "m", seed=1)
    args = ftrl.GRPOConfig(
        **base_args(
            tmp_path / "run",
            max_steps=30,
            learning_rate=0.02,
            optim="adamw_torch",
            per_device_train_batch_size=8,
            num_generations=8,
            gradient_accumulation_steps=1,
            max_completion_length=8,
            logging_steps=5,
        ),
        tree_packing=True,
    )
    trainer = ftrl.GRPOTrainer(
        model=path, reward_funcs=letter_reward, args=args, train_dataset=prompt_dataset(n=16)
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert rewards[-1] > rewards[0] + 0.3, rewards


# ---------------------------------------------------------------------- data parallel
def _dp_train(model: str, out: Path, mode: str, per_device: int, balance: str | None = None) -> dict | None:
    """Train ``mode`` ("tree": the plugin, "stock": TRL) for two steps on this process's ranks; with
    ``balance``, on skewed prompts (long and short: two whole groups per micro-batch and rank), and
    the plugin with ``tree_balance=balance``. The main process returns its parameters, world and
    balance log; the others None."""
    from datasets import Dataset

    kw = {}
    if balance is not None:
        long, short = prompt_dataset(8, long=40)["prompt"], prompt_dataset(8)["prompt"]
        kw = dict(
            dataset=Dataset.from_dict({"prompt": [p for pair in zip(long, short, strict=True) for p in pair]})
        )
        if mode == "tree":
            kw["tree_balance"] = balance
    params, tr = train(
        model, out / mode, mode == "tree", per_device_train_batch_size=per_device, max_steps=2, **kw
    )
    if not tr.accelerator.is_main_process:
        return None
    moved = [h["tree/balance_moved_rows"] for h in tr.state.log_history if "tree/balance_moved_rows" in h]
    return {
        "params": params,
        "world": tr.accelerator.num_processes,
        "type": str(tr.accelerator.distributed_type),
        "moved": moved,
    }


@pytest.mark.slow
def test_data_parallel_two_processes_equals_one(model_path, init, tmp_path):
    dp = run_on_ranks(_dp_train, 2, model_path, tmp_path, "tree", 2, init_group=False)[0]
    assert (dp["world"], dp["type"]) == (2, "DistributedType.MULTI_CPU"), dp["type"]
    one = run_in_subprocess(_dp_train, model_path, tmp_path, "stock", 4)
    assert_equals_stock(one["params"], dp["params"], init, TOL)


@pytest.mark.slow
def test_tree_balance_moves_rows_and_keeps_the_update(model_path, init, tmp_path):
    """Two ranks holding long- and short-prompt groups: tree_balance moves rows between them (logged)
    and the parameters still equal stock TRL in one process on the same rollouts."""
    dp = run_on_ranks(_dp_train, 2, model_path, tmp_path, "tree", 8, "on", init_group=False)[0]
    moved, steps = sum(dp["moved"]), len(dp["moved"])
    assert steps == 2 and moved > 0, dp["moved"]
    one = run_in_subprocess(_dp_train, model_path, tmp_path, "stock", 16, "on")
    assert_equals_stock(one["params"], dp["params"], init, TOL)


def test_tree_balance_refuses_a_composition_dependent_loss(model_path, tmp_path):
    from forkrl.plugins.trl import balance

    class Fake:
        loss_type, _entropy_bonus_enabled, top_entropy_quantile = "bnpo", False, 1.0

        def _own_loss(self):
            return True

    assert "bnpo" in balance.unsafe_reason(Fake())
    Fake.loss_type = "dapo"
    assert balance.unsafe_reason(Fake()) is None
    Fake._entropy_bonus_enabled = True
    assert "entropy bonus" in balance.unsafe_reason(Fake())
    Fake._entropy_bonus_enabled, Fake.aux_loss_enabled = False, True
    assert "router load-balancing" in balance.unsafe_reason(Fake())


# ---------------------------------------------------------------------- configuration and contracts
def test_config_validation(tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="tree_mode='fast' is not one of"):
        ftrl.GRPOConfig(**common, tree_packing=True, tree_mode="fast")
    with pytest.raises(ValueError, match="tree_block_size=0"):
        ftrl.GRPOConfig(**common, tree_packing=True, tree_block_size=0)
    with pytest.raises(ValueError, match="would have no effect"):
        ftrl.GRPOConfig(**common, tree_mode="keep")
    with pytest.raises(ValueError, match="contradicts tree_mode='keep'"):
        ftrl.GRPOConfig(**common, long_context_replay=True, tree_mode="keep")
    with pytest.raises(ValueError, match="only applies with long_context_replay"):
        ftrl.GRPOConfig(**common, tree_packing=True, long_context_prompt_grad="none")
    with pytest.raises(ValueError, match="must be True or False"):
        ftrl.GRPOConfig(**common, tree_packing="yes")
    ok = ftrl.GRPOConfig(**common, long_context_replay=True, long_context_prompt_grad="none")
    assert ok.tree_enabled and not ok.tree_packing
    # core's rules reach TRL's config unchanged (TreeOptions / SpeculativeOptions are inherited)
    with pytest.raises(ValueError, match="tree_replay_threshold set but tree_packing=False"):
        ftrl.GRPOConfig(**common, tree_replay_threshold=4096)
    with pytest.raises(ValueError, match="speculative_bits set but speculative_rollout=False"):
        ftrl.GRPOConfig(**common, speculative_bits=8)
    with pytest.raises(ValueError, match="tree_replay_threshold=True must be an integer"):
        ftrl.GRPOConfig(**common, tree_packing=True, tree_replay_threshold=True)
    with pytest.raises(ValueError, match="speculative_group_size=32.0 is not one of"):
        ftrl.GRPOConfig(**common, speculative_rollout=True, speculative_group_size=32.0)
    # "was it set", not "does it differ from the default": 4 is the 'always' policy's draft length
    with pytest.raises(
        ValueError, match="speculative_draft_len only applies with speculative_policy='always'"
    ):
        ftrl.GRPOConfig(**common, speculative_rollout=True, speculative_draft_len=4)
    with pytest.raises(ValueError, match="tree_replay_threshold only applies with tree_mode='auto'"):
        ftrl.GRPOConfig(**common, tree_packing=True, tree_mode="replay", tree_replay_threshold=16384)


def _build(tmp_path, model, config=None, **kw):
    from .trl_helpers import byte_tokenizer

    return ftrl.GRPOTrainer(
        model=model,
        reward_funcs=letter_reward,
        args=config or ftrl.GRPOConfig(**base_args(tmp_path, **kw), tree_packing=True),
        train_dataset=prompt_dataset(),
        processing_class=byte_tokenizer(),
        rollout_func=make_rollout_func(),
    )


def test_settings_no_tree_can_reproduce_are_refused_when_built(model_path, tmp_path):
    """What a tree cannot make exact is refused by name before training, and what it can is
    checked before the first rollout (settings tried as a user would)."""
    from .trl_helpers import save_tiny_llama

    # NEFTune: noise per token of each sequence, scaled by the padded length
    with pytest.raises(ValueError, match="neftune_noise_alpha=5.0"):
        ftrl.GRPOConfig(**base_args(tmp_path, neftune_noise_alpha=5.0), tree_packing=True)
    # attention dropout (a config rate, which TRL's disable_dropout does not reach): one mask per prefix
    dropout = save_tiny_llama(tmp_path / "dropout", attention_dropout=0.1)
    with pytest.raises(ValueError, match="attention_dropout=0.1.*same dropout mask"):
        _build(tmp_path, dropout, disable_dropout=False)
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        _build(tmp_path, dropout, disable_dropout=True)
    # one process: balancing over ranks would do nothing
    with pytest.raises(ValueError, match="tree_balance='on'.*one process"):
        _build(
            tmp_path,
            model_path,
            config=ftrl.GRPOConfig(**base_args(tmp_path), tree_packing=True, tree_balance="on"),
        )
    # the default int4 group (128) does not divide the tiny model's width (32): said at build, by name
    with pytest.raises(ValueError, match="speculative_group_size=128.*in_features=32"):
        _build(tmp_path, model_path, config=ftrl.GRPOConfig(**base_args(tmp_path), speculative_rollout=True))
    _build(
        tmp_path,
        model_path,
        config=ftrl.GRPOConfig(**base_args(tmp_path), speculative_rollout=True, speculative_group_size=32),
    )


def test_a_missing_model_folder_is_named(tmp_path):
    with pytest.raises(ValueError, match="'/no/such/dir': no such model folder or hub id"):
        ftrl.GRPOTrainer(
            "/no/such/dir", letter_reward, args=ftrl.GRPOConfig(**base_args(tmp_path), tree_packing=True)
        )


def test_a_model_the_tree_cannot_reproduce_is_refused_for_its_reason_under_bf16(tmp_path):
    """Under TRL's bf16 autocast the probe still compares log-probs (a BERT-style decoder's head
    transform runs between decoder and head): the reason is the mismatch, not a dtype error, and it
    comes when the trainer is built."""
    from transformers import BertConfig, BertLMHeadModel

    from .trl_helpers import VOCAB

    bert = BertLMHeadModel(
        BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                   is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    )  # fmt: skip
    with pytest.raises(ValueError, match="log-probs differ from the model's forward.*turn tree_packing off"):
        _build(tmp_path, bert, bf16=True)


def test_trl_parser_reads_forkrl_flags_from_the_command_line(tmp_path):
    """TRL's own TrlParser (HfArgumentParser) takes forkrl's fields like any TRL flag: types and
    choices come from the core option dataclasses, and the values are validated."""
    from trl import TrlParser

    parser = TrlParser((ftrl.GRPOConfig,))
    (cfg,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--tree_packing", "--tree_mode",
         "replay", "--tree_block_size", "512", "--speculative_rollout", "--speculative_bits", "8"]
    )  # fmt: skip
    assert cfg.tree_packing is True and cfg.tree_mode == "replay" and cfg.tree_block_size == 512
    assert cfg.speculative_bits == 8 and cfg.speculative_group_size is None
    assert cfg.speculative_draft_len is None and cfg.draft_len == 4  # unset: the documented default
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--tree_mode", "fast"])


def test_absolute_position_models_are_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from .trl_helpers import EOS, PAD, VOCAB, byte_tokenizer

    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, pad_token_id=PAD, eos_token_id=EOS)
    )
    with pytest.raises(Exception, match="absolute position|no separate decoder"):
        ftrl.GRPOTrainer(
            model=model,
            reward_funcs=letter_reward,
            args=ftrl.GRPOConfig(**base_args(tmp_path), tree_packing=True),
            train_dataset=prompt_dataset(),
            processing_class=byte_tokenizer(),
            rollout_func=make_rollout_func(),
        )


def test_trl_contract_generation_attributes():
    for host in ("GRPOTrainer", "RLOOTrainer"):
        source = inspect.getsource(getattr(trl, host))
        for attr in ("max_completion_length", "temperature", "top_k", "top_p", "eos_token_ids"):
            assert f"self.{attr}" in source


# ---------------------------------------------------------------------- RLOO
@pytest.mark.parametrize(
    "cfg", [{}, dict(beta=0.1, num_iterations=2)], ids=["default", "beta-num-iterations"]
)
def test_rloo_plugin_equals_stock(cfg, model_path, init, tmp_path):
    """RLOO (sequence-level loss, old log-probs always scored): same update as stock trl.RLOOTrainer.
    TRL's own seeded generation produces the rollouts, identically in both runs."""
    stock, st = train_rloo(model_path, tmp_path / "stock", False, **cfg)
    tree, tt = train_rloo(model_path, tmp_path / "tree", True, **cfg)
    assert_equals_stock(stock, tree, init, TOL)
    assert _logged(tt)[-1]["tree/compression"] > 1.0
    for a, b in zip(_logged(st), _logged(tt), strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4, abs_tol=1e-6)


@pytest.mark.parametrize("name", ["deepseekv3", "kimik2"])
def test_multi_head_latent_attention_models_equal_stock(name, tmp_path):
    """DeepSeek-V3- and Kimi-K2-shaped models (multi-head latent attention over a latent cache,
    value heads narrower than query-key heads, MoE) train as stock TRL does."""
    from forkrl.core.testing.models import byte_model, byte_tokenizer, save_pretrained

    path = save_pretrained(byte_model(name), byte_tokenizer(), tmp_path / name)
    init = initial_params(path)
    stock, st = train(path, tmp_path / "stock", False)
    tree, tt = train(path, tmp_path / "tree", True)
    assert_same_run(stock, tree, init, st, tt)
