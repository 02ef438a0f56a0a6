"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) on a tree: exact over the latent cache.

The split attention runs MLA over the latent cache pieces with the up-projection absorbed into the
queries (:mod:`forkrl.core.attention.latent`); these tests hold it to plain per-sequence autograd
in float64 and to stock's accuracy in bf16.
"""

from __future__ import annotations

import pytest
import torch

from forkrl.core import PrefixForest, TreeExecutor, UnsupportedModelError
from forkrl.core.executor import RouterLoss
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.forests import deep_tree, grpo_group
from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err
from forkrl.core.testing.models import tiny_causal_lm as make_model

from .precision_check import check_follows_the_hosts_precision

TOL = 1e-12
MLA = ["deepseekv2", "deepseekv3", "kimik2"]


def _forest():
    a, fa = grpo_group(seed=2)
    b, fb = deep_tree()
    return a + b, fa + fb


@pytest.mark.parametrize("name", MLA)
@pytest.mark.parametrize("mode,block", [("keep", None), ("replay", 3)])
def test_mla_gradient_and_scores_are_exact_over_the_latent_cache(monkeypatch, name, mode, block):
    """Every parameter's gradient (attention, router, experts) and the scores equal plain autograd,
    with the latent split doing the attention of every non-root node, one piece per ancestor."""
    import forkrl.core.attention.split as split

    monkeypatch.setattr(split, "MIN_PIECE", 1)
    latent_calls = []
    real = split._SplitAttention.apply

    def counting(*args):
        latent_calls.append(args[8])  # the latent flag
        return real(*args)

    monkeypatch.setattr(split._SplitAttention, "apply", counting)
    model = make_model(name)
    seqs, sf = _forest()
    g = torch.Generator().manual_seed(5)
    coefs = [torch.randn(len(s) - f, generator=g, dtype=torch.float64) for s, f in zip(seqs, sf, strict=True)]
    with Float64Mode():
        lps, _ = dense_logprobs(model, seqs, sf)
        sum((lp * c).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
        want = grads(model)
        model.zero_grad(set_to_none=True)
        forest = PrefixForest.build(seqs, sf)
        ex = TreeExecutor(model, mode=mode, block_size=block)
        res = ex.backward(forest, coefs)
        scored = ex.score(forest)
    want_lp = [lp.detach() for lp in lps]
    assert ex.split_attention, "the probe fell back to the model's own attention"
    assert latent_calls and all(latent_calls)
    assert max_rel_err(grads(model), want) < TOL
    assert max_rel_err(res.logprobs, want_lp) < TOL
    assert max_rel_err(scored.logprobs, want_lp) < TOL


@pytest.mark.parametrize("lora", [False, True])
def test_mla_expanded_paths_are_exact(lora):
    """The paths that expand the latent are exact too: the model's own attention (a mask), and the
    split pass with a LoRA-wrapped ``kv_b_proj`` (not absorbable: expanded over the context)."""
    model = make_model("deepseekv3")
    if lora:
        peft = pytest.importorskip("peft", reason="peft is in the dev extra")
        config = peft.LoraConfig(r=2, target_modules=["kv_b_proj", "q_b_proj"], init_lora_weights=False)
        model = peft.get_peft_model(model, config)
    seqs, sf = _forest()
    coefs = [torch.ones(len(s) - f, dtype=torch.float64) for s, f in zip(seqs, sf, strict=True)]
    with Float64Mode():
        lps, _ = dense_logprobs(model, seqs, sf)
        sum((lp * c).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
        want = grads(model)
        model.zero_grad(set_to_none=True)
        ex = TreeExecutor(model, mode="keep", split_attention=lora)
        ex.backward(PrefixForest.build(seqs, sf), coefs)
    assert ex.split_attention == lora
    assert max_rel_err(grads(model), want) < TOL


def test_mla_router_loss_is_refused_where_the_model_has_none():
    """DeepSeek-V2/V3 in transformers compute no router load-balancing loss (V3 balances by its
    score-correction bias): a router loss is refused before any gradient, the tree still trains."""
    model = make_model("deepseekv3")
    seqs, sf = _forest()
    forest = PrefixForest.build(seqs, sf)
    ex = TreeExecutor(model, mode="keep")
    with pytest.raises(UnsupportedModelError, match="router load-balancing loss"):
        ex.score(forest, router=RouterLoss([1.0]).bind(forest, [0, len(seqs)]))
    assert all(p.grad is None for p in model.parameters())
    ex.backward(forest, [torch.ones(len(s) - f, dtype=torch.float64) for s, f in zip(seqs, sf, strict=True)])


@pytest.mark.parametrize("precision", ["autocast", "bf16"])
def test_mla_follows_the_hosts_precision(monkeypatch, precision):
    """In bf16 (autocast over float32, or bf16 parameters) the latent split is a bf16 computation of
    stock's accuracy (the criterion of tests/core/test_precision.py)."""
    import forkrl.core.attention.split as split

    monkeypatch.setattr(split, "MIN_SPLIT_ELEMENTS", 0)
    check_follows_the_hosts_precision("kimik2", precision, "replay")
