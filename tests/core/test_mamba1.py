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
from forkrl.core.testing.forests import deep_tree, grpo_group
from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err
from forkrl.core.testing.models import tiny_causal_lm as make_model

from .precision_check import check_follows_the_hosts_precision

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


def _step_inputs():
    """One Mamba-2 step's arguments in float64, each a fresh leaf (2 heads of width 3 in one group,
    state size 4)."""
    g = torch.Generator().manual_seed(11)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    state = rand(2, 2, 3, 4)  # [b, heads, head_dim, n]
    kwargs = dict(
        hidden_states=rand(2, 2, 3), dt=rand(2, 2, 3), A=-torch.rand(2, 3, 4, generator=g, dtype=torch.float64),
        B=rand(2, 1, 4), C=rand(2, 1, 4), D=rand(2, 3), dt_bias=rand(2, 3), dt_softplus=True, z=rand(2, 2, 3),
    )  # fmt: skip
    return state, kwargs


def _plain_step(state, hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z):
    """The Mamba-2 recurrence for one token, written out: (y, new state)."""
    dt = torch.nn.functional.softplus(dt + dt_bias)[..., None]  # [b, heads, head_dim, 1]
    new = state * torch.exp(dt * A) + dt * B[:, :, None, :] * hidden_states[..., None]  # one group: all heads
    y = (new * C[:, :, None, :]).sum(-1) + hidden_states * D
    return y * torch.nn.functional.silu(z), new


@pytest.mark.parametrize("form", ["rides_on_the_state", "written_into_the_copy"])
def test_mamba2_step_forms_are_exact_and_take_a_backward(form):
    """The one-token Mamba-2 step tree passes swap in, in both forms: up to transformers 5.24 the
    mixer steps the cache's state (a view of the parent's leaf) and the new state rides on it; from
    5.25 the mixer steps a clone it then stores, which must end up holding the new state. Both give
    the recurrence's output, new state and every input's gradient in float64, and transformers' own
    step gives the same values but cannot take a backward through the previous state."""
    from transformers.models.mamba2 import modeling_mamba2

    from forkrl.core import compat

    def run(step):
        state, kw = _step_inputs()
        if step is _plain_step:
            out, new_state = _plain_step(state, **kw)
        elif form == "rides_on_the_state":
            seen = state.view_as(state)
            out = step(seen, **kw)
            new_state = seen.forkrl_next
        else:
            new_state = state.clone()
            out = step(new_state, **kw)
        values = [out.detach().clone(), new_state.detach().clone()]
        (out.sum() + new_state.square().sum()).backward()
        return values, [state.grad] + [
            t.grad for t in kw.values() if isinstance(t, torch.Tensor) and t.requires_grad
        ]

    with Float64Mode():
        want, want_grads = run(_plain_step)
        got, got_grads = run(
            compat.ssm._ssm_step if form == "rides_on_the_state" else compat.ssm._ssm_step_on_copy
        )
        assert max_rel_err(got, want) < TOL and max_rel_err(got_grads, want_grads) < TOL
        state, kw = _step_inputs()
        copy = state.clone()
        out = modeling_mamba2.mamba2_selective_state_update(copy, **kw)
        assert max_rel_err([out, copy], want) < TOL
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (out.sum() + copy.square().sum()).backward()
