"""The tree in the precision users train in: bf16 autocast over float32 parameters, bf16 parameters.

The float64 tests elsewhere hold the tree to 1e-10; here it must compute as the model's own forward
does under the same settings. In bf16 no two computations agree to float tolerance (the host's own
batch layout moves stock's bf16 gradient by 0.3-0.8 of its distance to float32: measured in
:func:`test_stock_layouts_differ_by_bf16_noise`), so the criterion is two-sided, per quantity (the
vector of all log-probs, the vector of all parameter gradients), against stock in float32:

    0.5 * gap <= |tree_bf16 - stock_fp32| <= 1.5 * gap,   gap = |stock_bf16 - stock_fp32|

The lower bound fails when the tree ignores the host's precision (a float32 tree under bf16
autocast is ~0 from float32); the upper one when it is less accurate than stock (a log-softmax in
bf16, a gradient accumulated in bf16). With bf16 parameters, float32 stock runs on the same
bf16-rounded weights, so the gap is the computation's rounding alone. (The hosts' tests compare
parameters after several optimizer steps, where bf16 parameters' own rounding also counts.)
"""

from __future__ import annotations

import pytest
import torch

from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.executor import RouterLoss
from forkrl.core.testing import Bf16Rounding
from forkrl.core.testing.forests import grpo_group
from forkrl.core.testing.models import dense_logprobs, grads
from forkrl.core.testing.models import tiny_causal_lm as make_model

from .precision_check import (
    check_follows_the_hosts_precision,
    flat,
    stock_pass,
    tree_pass,
    zoo_batch,
    zoo_coefs,
)

ZOO = ["llama-gqa", "qwen2", "qwen3", "gemma2", "qwen3moe", "lfm2"]
PRECISIONS = ["autocast", "bf16"]


def _modes(name: str) -> list[str]:
    return ["keep", "replay"] if name in ("gemma2", "lfm2") else ["keep", "replay", "packed"]


CASES = [(n, p, m) for n in ZOO for p in PRECISIONS for m in _modes(n)]


@pytest.mark.parametrize("name,precision,mode", CASES)
def test_tree_follows_the_hosts_precision(monkeypatch, name, precision, mode):
    """Scoring and training, every mode, split attention on (forced at these sizes), MoE router
    loss and a hybrid: the tree in bf16 is a bf16 computation of stock's accuracy."""
    import forkrl.core.attention.split as split

    monkeypatch.setattr(split, "MIN_SPLIT_ELEMENTS", 0)
    check_follows_the_hosts_precision(name, precision, mode, router=name == "qwen3moe")


def test_float32_is_unchanged_by_the_precision_work(monkeypatch):
    """Without autocast a float32 tree stays exact to float32 (the float64 tests hold it to 1e-10)."""
    import forkrl.core.attention.split as split

    monkeypatch.setattr(split, "MIN_SPLIT_ELEMENTS", 0)
    seqs, sf = zoo_batch()
    model = make_model("qwen2", dtype=torch.float32)
    lp, g = stock_pass(model, seqs, sf, zoo_coefs(), False)
    tlp, tg = tree_pass(model, "keep", seqs, sf, zoo_coefs(), False)
    assert float((tlp - lp).norm() / lp.norm()) < 1e-6
    assert float((tg - g).norm() / g.norm()) < 1e-5


def test_the_criterion_catches_a_tree_that_ignores_autocast(monkeypatch):
    """The lower bound is not vacuous: a tree pass run in float32 under the host's bf16 autocast
    (what forkrl did before it followed autocast) fails it."""
    seqs, sf = zoo_batch()
    model = make_model("llama-gqa", dtype=torch.float32, attn="eager")
    exact = stock_pass(model, seqs, sf, zoo_coefs(), False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock = stock_pass(model, seqs, sf, zoo_coefs(), False)
    tree = tree_pass(model, "keep", seqs, sf, zoo_coefs(), False)  # autocast off: float32
    with pytest.raises(AssertionError, match="want 0.5"):
        Bf16Rounding("float32 tree", tree[1], stock[1], exact[1]).check_follows()


def test_stock_layouts_differ_by_bf16_noise():
    """Why the criterion is two-sided: stock itself, run on a right-padded batch instead of one
    sequence at a time, moves its bf16 gradient by a large part of its distance to float32."""
    seqs, sf = zoo_batch()
    coefs = zoo_coefs()
    model = make_model("llama-gqa", dtype=torch.float32)
    exact = stock_pass(model, seqs, sf, coefs, False)[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        single = stock_pass(model, seqs, sf, coefs, False)[1]
        model.zero_grad(set_to_none=True)
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(seqs):
            ids[b, : len(s)], mask[b, : len(s)] = torch.tensor(s), 1
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    lps = [
        logp[b, f - 1 : len(s) - 1].gather(-1, ids[b, f : len(s), None])[:, 0]
        for b, (s, f) in enumerate(zip(seqs, sf, strict=True))
    ]
    sum((lp * c).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
    padded = flat(grads(model))
    gap = float((single - exact).norm())
    assert 0.2 * gap < float((padded - single).norm()) < 1.5 * gap


def test_probe_accepts_bf16_hosts_and_still_refuses_broken_caches(monkeypatch):
    """The first-use probes check the architecture in the parameters' precision with autocast off,
    also inside a forward a host wrapped in autocast (accelerate's mixed precision): models exact in
    float32 are accepted under bf16 autocast (a probe in bf16 would refuse them for rounding), and a cache that
    drops the ancestors' keys is still refused there."""
    from forkrl.core import UnsupportedModelError
    from forkrl.core.executor import cache

    seqs, sf = zoo_batch()
    forest = PrefixForest.build(seqs, sf)
    for name in ("qwen3", "gemma2", "qwen3moe", "nemotronh"):
        model = make_model(name, dtype=torch.float32)
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)  # as accelerate wraps it
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ex = TreeExecutor(model, mode="keep")
            ex.score(
                forest, router=RouterLoss([1.0]).bind(forest, [0, len(seqs)]) if name == "qwen3moe" else None
            )
        assert ex._probed and (ex._router_probed or name != "qwen3moe")

    def dropping(self, key_states, value_states, *args, **kwargs):
        self.new_keys, self.new_values = key_states, value_states
        return key_states, value_states  # the ancestors' keys are lost

    monkeypatch.setattr(cache.RecordingLayer, "update", dropping)
    monkeypatch.setattr(cache.PiecewiseLayer, "update", dropping)
    monkeypatch.setattr(cache.LevelLayer, "update", dropping)
    model = make_model("qwen3", dtype=torch.float32)
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(UnsupportedModelError, match="cache contract"),
    ):
        TreeExecutor(model, mode="keep").score(forest)


def test_a_probe_that_falls_back_leaves_autocast_as_the_host_set_it():
    """Falcon's split-attention probe raises inside the decoder (the pass falls back to its own
    attention): the probe's autocast-off context must close before the outer one; closed after it,
    it would leave autocast off for the rest of the process, and the tree and everything after it
    would run in float32 under a bf16 host. The tree's log-probs must be stock's bf16 ones, and autocast still on."""
    import transformers

    torch.manual_seed(0)
    config = transformers.FalconConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True
    )
    model = transformers.FalconForCausalLM(config).eval()
    seqs, sf = grpo_group(prompt=9, group=3)
    forest = PrefixForest.build(seqs, sf)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        stock = torch.cat(dense_logprobs(model, seqs, sf)[0])
        tree = torch.cat(TreeExecutor(model, mode="keep").score(forest).logprobs)
        assert torch.is_autocast_enabled("cpu")
    with torch.no_grad():
        exact = torch.cat(dense_logprobs(model, seqs, sf)[0])
    assert (stock - exact).abs().max() > 1e-4  # bf16 rounded something
    assert torch.equal(tree, stock)
