"""Bad input gets a clear error naming the argument and the rule, raised before any state changes,
or the correct result; each case here was a silent wrong result or a raw crash before."""

from __future__ import annotations

import math

import pytest
import torch

from forkrl.core import PrefixForest, TreeExecutor, TreeOptions
from forkrl.core.objective import backward_loss
from forkrl.core.speculative import Drafter, SpeculativeOptions, SpeculativeSampler
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.forests import grpo_group
from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err
from forkrl.core.testing.models import tiny_causal_lm as make_model


def _setup(dtype=torch.float64):
    model = make_model("llama-gqa", dtype=dtype)
    seqs, sf = grpo_group()
    forest = PrefixForest.build(seqs, sf)
    coefs = [
        torch.randn(len(s) - f, dtype=dtype, generator=torch.Generator().manual_seed(i))
        for i, (s, f) in enumerate(zip(seqs, sf, strict=True))
    ]
    return model, seqs, sf, forest, coefs


def _untouched(model) -> bool:
    return all(p.grad is None for p in model.parameters())


def test_backward_with_grad_mode_off_raises_and_accumulates_nothing():
    model, _, _, forest, coefs = _setup()
    ex = TreeExecutor(model)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx(), pytest.raises(RuntimeError, match=r"grad mode off .*nothing was accumulated"):
            ex.backward(forest, coefs)
    assert _untouched(model)


def test_coefficients_of_an_integer_dtype_are_refused():
    model, _, _, forest, coefs = _setup()
    mixed = [coefs[0].round().to(torch.int64), *coefs[1:]]
    with pytest.raises(ValueError, match=r"grad_logprobs: sequence 0: values of dtype torch.int64"):
        TreeExecutor(model).backward(forest, mixed)
    assert _untouched(model)


def test_coefficients_of_mixed_float_dtypes_keep_full_precision():
    model, _, _, forest, coefs = _setup()
    with Float64Mode():
        TreeExecutor(model).backward(forest, [coefs[0].float(), *coefs[1:]])
        got = grads(model)
        model.zero_grad(set_to_none=True)
        TreeExecutor(model).backward(forest, [coefs[0].float().double(), *coefs[1:]])
    # The float32 tensor is exactly representable in float64: both runs see the same coefficients.
    assert max_rel_err(got, grads(model)) < 1e-14


def test_token_ids_outside_the_vocabulary_are_refused_before_anything_runs():
    model, seqs, sf, _, coefs = _setup()
    vocab = model.config.vocab_size
    bad = [list(s) for s in seqs]
    bad[2][-1] = vocab  # one past the last id
    forest = PrefixForest.build(bad, sf)
    ex = TreeExecutor(model)
    with pytest.raises(ValueError, match=rf"sequence 2 holds token id {vocab} .* vocabulary of {vocab}"):
        ex.score(forest)
    with pytest.raises(ValueError, match=r"vocabulary"):
        ex.backward(forest, coefs)
    assert _untouched(model)


def test_coefficients_that_require_grad_are_constants_as_in_autograd():
    model, seqs, sf, forest, coefs = _setup()
    scale = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    with Float64Mode():
        TreeExecutor(model).backward(forest, [c * scale for c in coefs])  # coefficients inside a graph
        got = grads(model)
        model.zero_grad(set_to_none=True)
        lps, _ = dense_logprobs(model, seqs, sf)
        torch.autograd.backward(lps, [(c * 2.0) for c in coefs])
    assert max_rel_err(got, grads(model)) < 1e-10
    assert scale.grad is None  # nothing flowed into the user's graph


@pytest.mark.parametrize("token_local", [True, False], ids=["token-local", "two-pass"])
def test_a_nan_loss_with_a_finite_gradient_raises_and_accumulates_nothing(token_local):
    model, _, _, forest, _ = _setup()

    def nan_constant(lp, ent, mask):
        return (lp * mask).sum() + float("nan")  # a NaN term that does not depend on the log-probs

    with Float64Mode(), pytest.raises(ValueError, match=r"loss is nan .*nothing was accumulated"):
        backward_loss(TreeExecutor(model), forest, nan_constant, token_local=token_local)
    assert _untouched(model)


@pytest.mark.parametrize("token_local", [True, False], ids=["token-local", "two-pass"])
def test_a_masked_mean_over_no_scored_token_raises(token_local):
    model, seqs, _, _, _ = _setup()
    forest = PrefixForest.build(seqs, [len(s) for s in seqs])  # every sequence scores nothing

    def masked_mean(lp, ent, mask):
        return (lp * mask).sum() / mask.sum()

    with Float64Mode(), pytest.raises(ValueError, match=r"loss is nan"):
        backward_loss(TreeExecutor(model), forest, masked_mean, token_local=token_local)
    assert _untouched(model)


def test_a_loss_that_is_not_a_tensor_is_named():
    model, _, _, forest, _ = _setup()
    with pytest.raises(TypeError, match=r"loss_fn must return a scalar torch.Tensor .* got float"):
        backward_loss(TreeExecutor(model), forest, lambda lp, ent, mask: 0.5, token_local=False)
    assert _untouched(model)


@pytest.mark.parametrize("score_from", [None, 3.0, "11"])
def test_forest_without_score_from_names_the_argument(score_from):
    seqs, _ = grpo_group()
    with pytest.raises(TypeError, match="score_from must give one completion start per sequence"):
        PrefixForest.build(seqs, score_from)
    with pytest.raises(TypeError, match="sequences must be a list of token sequences"):
        PrefixForest.build(None, [1])


# ---------------------------------------------------------------------- the sampler
def _sampler():
    model = make_model("llama-gqa", dtype=torch.float32, intermediate_size=64)
    return model, SpeculativeSampler(model, Drafter.from_policy(model, bits=4, group_size=32))


def test_sampler_refuses_right_padded_prompts():
    model, sampler = _sampler()
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # row 0: padding after its prompt
    with pytest.raises(
        ValueError, match=r"rows \[0\] of attention_mask have padding after a prompt token.*left-pad"
    ):
        sampler.generate(ids, mask, max_new_tokens=3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=math.nan), "temperature=nan must be a finite number"),
        (dict(temperature=math.inf), "temperature=inf"),
        (dict(temperature=True), "temperature=True"),
        (dict(max_new_tokens=2.5), r"max_new_tokens=2.5 must be a positive integer"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(top_k=2.0), "top_k=2.0"),
        (dict(top_p=math.nan), "top_p=nan"),
    ],
)
def test_sampler_refuses_bad_sampling_settings(kwargs, match):
    model, sampler = _sampler()
    ids = torch.tensor([[5, 6, 7, 8]])
    args = dict(max_new_tokens=3) | kwargs
    with pytest.raises(ValueError, match=match):
        sampler.generate(ids, **args)


# ---------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tree_replay_threshold=4096), "tree_replay_threshold set but tree_packing=False"),
        (dict(tree_block_size=512), "tree_block_size set but"),
        (
            dict(tree_packing=True, tree_replay_threshold=True),
            r"tree_replay_threshold=True must be an integer",
        ),
        (dict(tree_packing=True, tree_block_size=2.0), r"tree_block_size=2.0 must be an integer"),
        (dict(tree_packing=True, tree_block_size=0), r"tree_block_size=0 must be >= 1"),
        (dict(tree_packing=1), "tree_packing must be True or False"),
        (dict(tree_packing=True, tree_mode="fast"), r"tree_mode='fast' is not one of"),
        (dict(long_context_replay=True, tree_mode="packed"), "contradicts tree_mode='packed'"),
        # a setting the chosen mode ignores is an error, also when it equals the value used when unset
        (
            dict(tree_packing=True, tree_mode="keep", tree_replay_threshold=16384),
            "only applies with tree_mode='auto'",
        ),
        (
            dict(long_context_replay=True, tree_replay_threshold=100),
            "long_context_replay=True fixes the mode",
        ),
        (
            dict(tree_packing=True, tree_mode="packed", tree_block_size=2048),
            "no effect with tree_mode='packed'",
        ),
    ],
)
def test_tree_options_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TreeOptions(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(speculative_bits=8), "speculative_bits set but speculative_rollout=False"),
        (dict(speculative_margin=0.5), "speculative_margin set but"),
        (
            dict(speculative_rollout=True, speculative_draft_len=True),
            r"speculative_draft_len=True must be an integer",
        ),
        (
            dict(speculative_rollout=True, speculative_group_size=32.0),
            r"speculative_group_size=32.0 is not one of",
        ),
        (
            dict(speculative_rollout=True, speculative_group_size=48),
            r"speculative_group_size=48 is not one of",
        ),
        (dict(speculative_rollout=True, speculative_bits=True), r"speculative_bits=True is not one of"),
        (
            dict(speculative_rollout=True, speculative_bits=8, speculative_group_size=64),
            "int8 drafters are per channel",
        ),
        (
            dict(speculative_rollout=True, speculative_margin=math.nan),
            "speculative_margin=nan must be a finite number",
        ),
        (
            dict(speculative_rollout=True, speculative_draft_len=3),
            "only applies with speculative_policy='always'",
        ),
        # the documented default, set by the user, is still a setting the 'auto' policy ignores
        (
            dict(speculative_rollout=True, speculative_draft_len=4),
            "only applies with speculative_policy='always'",
        ),
        (
            dict(speculative_rollout=True, speculative_policy="always", speculative_margin=0.1),
            "speculative_margin only applies with speculative_policy='auto'",
        ),
    ],
)
def test_speculative_options_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeOptions(**kwargs)


def test_valid_options_pass():
    assert TreeOptions(tree_packing=True, tree_mode="replay", tree_block_size=512).replay_block_size == 512
    assert TreeOptions(long_context_replay=True, long_context_prompt_grad="none").tree_enabled
    opts = SpeculativeOptions(speculative_rollout=True, speculative_policy="always", speculative_draft_len=3)
    assert opts.drafter_group_size == 128
    assert SpeculativeOptions(speculative_rollout=True, speculative_bits=8).drafter_group_size is None
    # unset numbers take their documented defaults
    assert SpeculativeOptions(speculative_rollout=True, speculative_policy="always").draft_len == 4
    assert SpeculativeOptions(speculative_rollout=True).margin == 0.1
    assert TreeOptions(tree_packing=True).replay_threshold == 16384
    assert TreeOptions(tree_packing=True, tree_replay_threshold=10).mode_for(11) == "replay"
    # tree_block_size with keep bounds the scoring forward: accepted
    assert (
        TreeOptions(tree_packing=True, tree_mode="keep", tree_block_size=64).executor_kwargs("keep")[
            "block_size"
        ]
        == 64
    )


def test_unsupported_model_message_names_the_way_out_once():
    """A plugin says how to switch tree training off in its host's words, once (not "...train this
    model without tree_packing; or turn tree_packing off")."""
    from forkrl.core import UnsupportedModelError

    err = UnsupportedModelError("X has no LM head: train this model without tree_packing")
    assert str(err.for_host("turn tree_packing off")) == "X has no LM head: turn tree_packing off"
    other = UnsupportedModelError("packed mode needs sdpa: use mode='keep'")
    assert str(other.for_host("train without --forkrl.tree_packing")) == (
        "packed mode needs sdpa: use mode='keep'; or train without --forkrl.tree_packing"
    )
