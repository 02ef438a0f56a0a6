"""Mamba-1 state models on a tree: Mamba, FalconMamba, Jamba (Mamba + attention + MoE), Zamba
(and the pure Mamba-2, which like Mamba takes no position ids).

transformers' Mamba-1 mixers scan multi-token input from a zero state; a tree pass scans each node
from its parent's final state instead (:mod:`forkrl.core.executor.scan`), and the pure SSMs, whose
forward takes no position ids, run without them. These tests hold the tree to plain per-sequence
autograd in float64, check that the tiny models' state is large enough for that to mean something,
and hold one bf16 case to stock's accuracy (the criterion of tests/core/test_precision.py).
"""

from __future__ import annotations

import pytest
import torch

from forkrl.core import PrefixForest, TreeExecutor, UnsupportedModelError
from forkrl.core.executor import scan
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err
from forkrl.core.testing.models import tiny_causal_lm as make_model

from .forests import deep_tree, grpo_group
from .test_precision import check_follows_the_hosts_precision

TOL = 1e-12
MAMBA1 = ["mamba", "falconmamba", "jamba", "zamba"]


def _forest():
    a, fa = grpo_group(seed=2)
    b, fb = deep_tree()
    return a + b, fa + fb


def _against_dense(model, mode: str, block: int | None, probe: bool = True):
    """(max relative error of the gradient, of the backward's log-probs, of the scores) against
    plain autograd, in float64."""
    seqs, sf = _forest()
    g = torch.Generator().manual_seed(5)
    coefs = [torch.randn(len(s) - f, generator=g, dtype=torch.float64) for s, f in zip(seqs, sf, strict=True)]
    with Float64Mode():
        model.zero_grad(set_to_none=True)
        lps, _ = dense_logprobs(model, seqs, sf)
        sum((lp * c).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
        want, want_lp = grads(model), [lp.detach() for lp in lps]
        model.zero_grad(set_to_none=True)
        forest = PrefixForest.build(seqs, sf)
        ex = TreeExecutor(model, mode=mode, block_size=block)
        ex._probed = not probe
        res = ex.backward(forest, coefs)
        scored = ex.score(forest)
    return (
        max_rel_err(grads(model), want),
        max_rel_err(res.logprobs, want_lp),
        max_rel_err(scored.logprobs, want_lp),
    )


@pytest.mark.parametrize(
    "name,mode,block",
    [(n, m, b) for n in MAMBA1 for m, b in (("keep", None), ("replay", 1))] + [("jamba", "replay", 3)],
)
def test_mamba1_is_exact_on_a_tree(name, mode, block):
    """Every parameter's gradient and the scores equal plain autograd: nodes of one token (block 1,
    the mixers' single-token path) and of several, sibling leaves batched over a shared state."""
    errs = _against_dense(make_model(name), mode, block)
    assert max(errs) < TOL, errs


@pytest.mark.parametrize("name", MAMBA1)
def test_a_dropped_state_is_seen(monkeypatch, name):
    """The control: with every node's scan restarted from zero (transformers' own multi-token path)
    the same comparison fails by far more than the tolerance, so the state matters in these models."""
    real = scan.selective_scan
    monkeypatch.setattr(scan, "selective_scan", lambda *args: real(*args[:-1], None))
    grad_err, lp_err, _ = _against_dense(make_model(name), "keep", None, probe=False)
    assert grad_err > 1e-7 and lp_err > 1e-10, (grad_err, lp_err)


@pytest.mark.parametrize("mode,block", [("keep", None), ("replay", 1)])
def test_pure_mamba2_is_exact_on_a_tree(mode, block):
    """The pure Mamba-2 SSM, run without position ids like Mamba, with its one-token step out of
    place as in the Mamba-2 hybrids."""
    assert max(_against_dense(make_model("mamba2"), mode, block)) < TOL


def test_pure_ssms_run_without_positions_and_packed_is_refused():
    """Mamba's forward takes no position ids and has nothing positional to give them to; a packed
    tree (one sequence under a mask) cannot route a recurrent state and is refused."""
    model = make_model("mamba")
    ex = TreeExecutor(model, mode="keep")
    assert not ex.adapter.takes_positions and len(ex.adapter.scan_mixers) == 2
    assert not TreeExecutor(make_model("mamba2"), mode="keep").adapter.takes_positions
    assert TreeExecutor(make_model("jamba"), mode="keep").adapter.takes_positions
    with pytest.raises(UnsupportedModelError, match="recurrent state"):
        TreeExecutor(model, mode="packed")


@pytest.mark.parametrize("name,precision", [("mamba", "autocast"), ("mamba", "bf16"), ("jamba", "autocast")])
def test_mamba1_follows_the_hosts_precision(monkeypatch, name, precision):
    """In bf16 (autocast over float32, or bf16 parameters: Mamba's residual stays float32 and its
    head casts it, as the tree's does) the tree is a bf16 computation of stock's accuracy."""
    import forkrl.core.attention.split as split

    monkeypatch.setattr(split, "MIN_SPLIT_ELEMENTS", 0)
    check_follows_the_hosts_precision(name, precision, "replay")
