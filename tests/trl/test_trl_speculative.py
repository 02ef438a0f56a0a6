"""forkrl's speculative rollouts inside TRL's GRPOTrainer (real TRL, tiny Llama, CPU).

The sampler's exactness (greedy identity, sampled distribution) is tested in
tests/core/test_speculative.py; here: TRL's generation goes through it, greedy rollouts and the
resulting update are identical to stock TRL's, the drafter is re-derived after optimizer steps, and
TRL's logs carry the speculation figures."""

from __future__ import annotations

import math

import pytest
import torch

trl = pytest.importorskip("trl")

from forkrl.core import quant  # noqa: E402
from forkrl.plugins import trl as ftrl  # noqa: E402
from forkrl.plugins.trl.speculative import TRLSpeculation  # noqa: E402

from .trl_helpers import SPEC, run_recording_rollouts, save_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-spec"))


def test_greedy_rollouts_equal_stock(model_path, tmp_path):
    greedy = dict(generation_kwargs={"do_sample": False})
    seen_stock, seen_spec = [], []
    stock, _ = run_recording_rollouts(model_path, tmp_path / "s", False, seen_stock, **greedy)
    spec, trainer = run_recording_rollouts(model_path, tmp_path / "t", True, seen_spec, **greedy, **SPEC)
    assert len(seen_spec) == 3 * 8 and seen_spec == seen_stock  # token-identical completions, step after step
    # (Greedy groups are identical, so advantages and the update are zero in both runs.)
    diff = {n: (spec[n] - stock[n]).abs().max().item() for n in stock if not torch.equal(spec[n], stock[n])}
    assert not diff, diff
    logged = [h for h in trainer.state.log_history if "spec/acceptance" in h]
    assert logged and all(0.0 <= h["spec/acceptance"] <= 1.0 for h in logged)
    # draft length 3 whenever it speculates (near the length budget a step may decode plainly)
    assert all(h["spec/speculated_fraction"] > 0.5 and h["spec/draft_len"] == 3.0 for h in logged)


def test_sampling_with_tree_packing_refreshes_the_drafter(model_path, tmp_path, monkeypatch):
    refreshed, policies = [], []
    original_refresh, original_sampler = quant.Drafter.refresh, TRLSpeculation.sampler

    def counting(self, model):
        refreshed.append(1)
        return original_refresh(self, model)

    def snapshot(self, model, prompt_lengths):
        sampler = original_sampler(self, model, prompt_lengths)
        policies.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return sampler

    monkeypatch.setattr(quant.Drafter, "refresh", counting)
    monkeypatch.setattr(TRLSpeculation, "sampler", snapshot)
    seen: list = []
    mean_id = lambda c: sum(c) / (260.0 * len(c))  # noqa: E731  (varies within every group)
    _, trainer = run_recording_rollouts(
        model_path, tmp_path / "t", True, seen, score=mean_id, max_steps=3, tree_packing=True, **SPEC
    )
    # One generation per optimizer step (steps_per_generation = gradient_accumulation_steps): the
    # drafter is built at the first and re-derived from the updated policy before each later one.
    assert len(refreshed) == 2 and len(policies) == 3
    assert not torch.equal(
        policies[0]["model.layers.0.mlp.up_proj.weight"], policies[2]["model.layers.0.mlp.up_proj.weight"]
    )
    drafter = trainer.forkrl_spec.rollout.current.drafter
    reference = save_tiny_llama(tmp_path / "last", seed=0)
    from transformers import LlamaForCausalLM

    last = LlamaForCausalLM.from_pretrained(reference)
    last.load_state_dict(policies[-1])
    fresh = quant.Drafter.from_policy(last, bits=4, group_size=32)
    for name in drafter.quantized:  # the drafter is exactly the quantized policy of the last rollout
        assert torch.equal(drafter.quantized[name].dequantize(), fresh.quantized[name].dequantize()), name
    logged = [h for h in trainer.state.log_history if "spec/rollout_time" in h][-1]
    assert logged["spec/rollout_time"] > 0 and "tree/compression" in logged
    assert len(seen) == 3 * 8 and all(1 <= len(c) <= 10 for c in seen)


def test_auto_policy_calibrates_and_logs(model_path, tmp_path):
    seen: list = []
    auto = {k: v for k, v in SPEC.items() if k != "speculative_draft_len"} | {"speculative_policy": "auto"}
    _, trainer = run_recording_rollouts(model_path, tmp_path / "a", True, seen, max_steps=1, **auto)
    policy = trainer.forkrl_spec.rollout.current.policy
    assert policy.mode == "auto" and policy.cost_model is not None
    last = [h for h in trainer.state.log_history if "spec/speculated_fraction" in h][-1]
    assert 0.0 <= last["spec/speculated_fraction"] <= 1.0
    assert math.isfinite(last["spec/rollout_time"])


def test_speculative_config_errors(tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="speculative_policy='always'"):  # the server fixes k when it starts
        ftrl.GRPOConfig(**common, speculative_rollout=True, use_vllm=True, vllm_mode="server")
    with pytest.raises(ValueError, match="min_p"):
        ftrl.GRPOConfig(**common, speculative_rollout=True, min_p=0.1)
    with pytest.raises(ValueError, match="repetition_penalty"):
        ftrl.GRPOConfig(**common, speculative_rollout=True, repetition_penalty=1.2)
    with pytest.raises(ValueError, match="speculative_bits=3"):
        ftrl.GRPOConfig(**common, speculative_rollout=True, speculative_bits=3)
    with pytest.raises(ValueError, match="speculative_policy"):
        ftrl.GRPOConfig(**common, speculative_rollout=True, speculative_policy="sometimes")
