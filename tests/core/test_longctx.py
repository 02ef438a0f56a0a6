"""Long-context replay: exact prompt gradients with block boundaries everywhere, memory flat in G."""

from __future__ import annotations

import pytest
import torch

from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.testing import Float64Mode, SavedBytes

from .models import dense_logprobs, grads, make_model, max_rel_err

TOL = 1e-10


def _long_group(P: int, G: int, R: int, vocab: int, seed: int = 0, vary: bool = True):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (P,), generator=g).tolist()
    seqs = [prompt + torch.randint(0, vocab, (R + (i % 3 if vary else 0),), generator=g).tolist() for i in range(G)]
    coefs = [torch.randn(len(s) - P, generator=g, dtype=torch.float64) for s in seqs]
    return seqs, [P] * G, coefs


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("name", ["llama-gqa", "lfm2", "qwen3next"])
@pytest.mark.parametrize("block", [1, 3, 64])
def test_exact_prompt_gradient_with_blocks(name, block, split, monkeypatch):
    """A prompt that is not a multiple of the block size; responses cross block boundaries too.

    With ``split`` the mask-free attention runs for every node that has a cache."""
    import forkrl.core.attention as attn

    monkeypatch.setattr(attn, "MIN_SPLIT_ELEMENTS", 0 if split else 1 << 62)
    model = make_model(name)
    seqs, sf, coefs = _long_group(P=37, G=3, R=5, vocab=model.config.vocab_size)
    forest = PrefixForest.build(seqs, sf)
    with Float64Mode():
        model.zero_grad(set_to_none=True)
        lps, _ = dense_logprobs(model, seqs, sf)
        sum((lp * c).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
        g_d = grads(model)
        model.zero_grad(set_to_none=True)
        res = TreeExecutor(model, mode="replay", block_size=block).backward(forest, coefs)
    assert max_rel_err(grads(model), g_d) < TOL
    assert max_rel_err(res.logprobs, [lp.detach() for lp in lps]) < TOL


def _saved_peak(model, P, G, R, prompt_grad, block):
    """Peak bytes autograd holds for backward, over one backward pass."""
    seqs, sf, coefs = _long_group(P, G, R, model.config.vocab_size, seed=1, vary=False)
    coefs = [c.float() for c in coefs]
    forest = PrefixForest.build(seqs, sf)
    ex = TreeExecutor(model, mode="replay", block_size=block, prompt_grad=prompt_grad)
    meter = SavedBytes()
    with meter.measure():
        ex.backward(forest, coefs)
    return meter.peak


@pytest.mark.parametrize("prompt_grad", ["exact", "none"])
def test_memory_does_not_grow_with_group_size(prompt_grad):
    model = make_model("llama-gqa", dtype=torch.float32, max_position_embeddings=2048)
    peak2 = _saved_peak(model, P=600, G=2, R=16, prompt_grad=prompt_grad, block=64)
    peak8 = _saved_peak(model, P=600, G=8, R=16, prompt_grad=prompt_grad, block=64)
    assert peak8 <= 1.02 * peak2
    # And the measure is not blind: a longer response does need more.
    peak_long = _saved_peak(model, P=600, G=2, R=200, prompt_grad=prompt_grad, block=64)
    assert peak_long > 1.05 * peak2
