"""The MoE router load-balancing loss on a tree against the model's own, per padded micro-batch."""

from __future__ import annotations

import pytest
import torch

from forkrl.core import PrefixForest, TreeExecutor, UnsupportedModelError
from forkrl.core.executor import RouterLoss
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.models import grads, max_rel_err
from forkrl.core.testing.models import tiny_causal_lm as make_model
from forkrl.core.testing.router import router_window, stock_router_losses

TOL = 1e-10


@pytest.mark.parametrize(
    "name,mode,block,score_first",
    [
        ("qwen3moe", "keep", None, False),
        ("qwen3moe", "keep", None, True),
        ("qwen3moe", "replay", 3, False),
        ("qwen3moe", "packed", None, False),
        ("mixtral", "keep", None, False),
        ("olmoe", "replay", None, True),
        ("gptoss", "keep", None, False),
        ("qwen3next", "replay", 2, False),
    ],
)
def test_router_loss_gradient_equals_stock(name, mode, block, score_first):
    with Float64Mode():
        model = make_model(name)
        seqs, sf, rows = router_window()
        weights = [0.3, 0.7, 0.5]
        g = torch.Generator().manual_seed(5)
        coefs = [
            torch.randn(len(s) - f, generator=g, dtype=torch.float64) for s, f in zip(seqs, sf, strict=True)
        ]
        want_values = stock_router_losses(model, seqs, sf, rows, weights, coefs)
        want = grads(model)
        model.zero_grad(set_to_none=True)

        ex = TreeExecutor(model, mode=mode, block_size=block)
        forest = PrefixForest.build(seqs, sf)
        router = RouterLoss(weights).bind(forest, rows)
        if score_first:
            ex.score(forest, router=router)
        ex.backward(forest, grad_logprobs=coefs, router=router)
        got = grads(model)
    assert max_rel_err(got, want) < TOL
    torch.testing.assert_close(router.values(), want_values, rtol=1e-10, atol=0)
    router_grad = [p.grad for n, p in model.named_parameters() if "router" in n or ".gate." in n]
    assert router_grad and all(g is not None and g.abs().sum() > 0 for g in router_grad)


def test_router_loss_alone_moves_only_what_routing_reaches():
    """With zero log-prob coefficients the gradient is the aux loss's alone (it can fail: a missing
    unit term or a miscounted multiplicity shows up here, not hidden under the policy gradient)."""
    with Float64Mode():
        model = make_model("qwen3moe")
        seqs, sf, rows = router_window()
        zeros = [torch.zeros(len(s) - f, dtype=torch.float64) for s, f in zip(seqs, sf, strict=True)]
        stock_router_losses(model, seqs, sf, rows, [1.0, 1.0, 1.0], zeros)
        want = grads(model)
        model.zero_grad(set_to_none=True)
        forest = PrefixForest.build(seqs, sf)
        TreeExecutor(model).backward(
            forest, grad_logprobs=zeros, router=RouterLoss([1.0] * 3).bind(forest, rows)
        )
    assert max_rel_err(grads(model), want) < TOL
    assert any(float(w.abs().sum()) > 0 for w in want)


def test_router_loss_bad_input_changes_nothing():
    model = make_model("qwen3moe")
    seqs, sf, rows = router_window()
    forest = PrefixForest.build(seqs, sf)
    with pytest.raises(ValueError, match="one weight per micro-batch"):
        RouterLoss([1.0, 1.0]).bind(forest, rows)
    with pytest.raises(ValueError, match="finite"):
        RouterLoss([float("nan")])
    other = PrefixForest.build(seqs[:3], sf[:3])
    router = RouterLoss([1.0]).bind(other, [0, 3])
    zeros = [torch.zeros(len(s) - f, dtype=torch.float64) for s, f in zip(seqs, sf, strict=True)]
    with pytest.raises(ValueError, match="bound to another forest"):
        TreeExecutor(model).backward(forest, grad_logprobs=zeros, router=router)
    assert all(p.grad is None for p in model.parameters())


def test_router_loss_refused_for_a_dense_model():
    model = make_model("llama-gqa")
    seqs, sf, rows = router_window()
    forest = PrefixForest.build(seqs, sf)
    zeros = [torch.zeros(len(s) - f, dtype=torch.float64) for s, f in zip(seqs, sf, strict=True)]
    with pytest.raises(UnsupportedModelError, match="router loss coefficient to 0"):
        TreeExecutor(model).backward(
            forest, grad_logprobs=zeros, router=RouterLoss([1.0] * 3).bind(forest, rows)
        )
    assert all(p.grad is None for p in model.parameters())


def test_router_loss_refused_for_a_moe_model_without_it():
    """Glm4-MoE routes tokens (aux-loss-free bias) but has no load-balancing loss to reproduce."""
    import transformers

    from forkrl.core import compat

    cfg = transformers.Glm4MoeConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, max_position_embeddings=128,
    )  # fmt: skip
    compat.set_experts_implementation(cfg, "eager")
    model = transformers.Glm4MoeForCausalLM(cfg).double()
    forest = PrefixForest.build([[1, 2, 3, 4], [1, 2, 5]], [2, 2])
    zeros = [torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)]
    with pytest.raises(UnsupportedModelError, match="router loss coefficient to 0"):
        TreeExecutor(model).backward(
            forest, grad_logprobs=zeros, router=RouterLoss([1.0]).bind(forest, [0, 2])
        )
    assert all(p.grad is None for p in model.parameters())
