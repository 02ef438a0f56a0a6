"""The bf16 criterion applied to a zoo model: the tree's log-probs and gradient against stock's in
the host's precision and in float32 (``Bf16Rounding.check_follows``), shared by the precision tests
of the attention zoo (test_precision), MLA (test_mla) and Mamba-1 (test_mamba1)."""

from __future__ import annotations

import contextlib
import functools

import torch

from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.executor import RouterLoss
from forkrl.core.testing import Bf16Rounding
from forkrl.core.testing.forests import deep_tree, grpo_group
from forkrl.core.testing.models import dense_logprobs, grads
from forkrl.core.testing.models import tiny_causal_lm as make_model


def flat(xs) -> torch.Tensor:
    return torch.cat([x.detach().double().flatten() for x in xs])


def zoo_batch():
    """A GRPO group of six and a deep tree: (sequences, score_from)."""
    a, fa = grpo_group(seed=3, group=6)
    b, fb = deep_tree()
    return a + b, fa + fb


def precision_context(precision: str):
    if precision == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def stock_pass(model, seqs, sf, coefs, router: bool):
    """Per-sequence log-probs and the gradient of ``sum coefs * logprobs`` (+ the aux loss of the
    whole batch as one padded micro-batch, for MoE models)."""
    model.zero_grad(set_to_none=True)
    lps, _ = dense_logprobs(model, seqs, sf)
    loss = sum((lp.float() * c).sum() for lp, c in zip(lps, coefs, strict=True))
    if router:
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(seqs):
            ids[b, width - len(s) :], mask[b, width - len(s) :] = torch.tensor(s), 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
        loss = loss + 0.5 * out.aux_loss.float()
    loss.backward()
    return flat(lps), flat(grads(model))


def tree_pass(model, mode, seqs, sf, coefs, router: bool):
    model.zero_grad(set_to_none=True)
    forest = PrefixForest.build(seqs, sf)
    ex = TreeExecutor(model, mode=mode, block_size=3 if mode == "replay" else None)
    scored = ex.score(forest)
    loss = RouterLoss([0.5]).bind(forest, [0, len(seqs)]) if router else None
    ex.backward(forest, coefs, router=loss)
    return flat(scored.logprobs), flat(grads(model))


@functools.cache
def zoo_coefs():
    seqs, sf = zoo_batch()
    g = torch.Generator().manual_seed(7)
    return [torch.randn(len(s) - f, generator=g) for s, f in zip(seqs, sf, strict=True)]


def check_follows_the_hosts_precision(name: str, precision: str, mode: str, router: bool = False) -> None:
    """The tree's log-probs and gradient of zoo model ``name`` under ``precision`` (``"autocast"``:
    bf16 autocast over float32; ``"bf16"``: bf16 parameters) against stock's in that precision and
    the float32 computation on the same (rounded) weights: ``Bf16Rounding.check_follows``."""
    seqs, sf = zoo_batch()
    coefs = zoo_coefs()
    model = make_model(name, dtype=torch.float32)
    if precision == "bf16":  # float32 stock then runs on the bf16-rounded weights: compute rounding only
        model = model.to(torch.bfloat16).float()
    exact = stock_pass(model, seqs, sf, coefs, router)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    with precision_context(precision):
        stock = stock_pass(model, seqs, sf, coefs, router)
        tree = tree_pass(model, mode, seqs, sf, coefs, router)
    for what, i in (("log-probs", 0), ("gradient", 1)):
        Bf16Rounding(f"{name} {precision} {mode} {what}", tree[i], stock[i], exact[i]).check_follows()
