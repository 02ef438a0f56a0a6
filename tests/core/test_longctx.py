"""Long-context replay: exact prompt gradients with block boundaries everywhere, memory flat in G."""

from __future__ import annotations

import warnings

import pytest
import torch

from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.testing import Float64Mode, SavedBytes
from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err
from forkrl.core.testing.models import tiny_causal_lm as make_model

TOL = 1e-10


def _long_group(P: int, G: int, R: int, vocab: int, seed: int = 0, vary: bool = True):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (P,), generator=g).tolist()
    seqs = [
        prompt + torch.randint(0, vocab, (R + (i % 3 if vary else 0),), generator=g).tolist()
        for i in range(G)
    ]
    coefs = [torch.randn(len(s) - P, generator=g, dtype=torch.float64) for s in seqs]
    return seqs, [P] * G, coefs


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("name", ["llama-gqa", "lfm2", "qwen3next", "falconh1"])
@pytest.mark.parametrize("block", [1, 3, 64])
def test_exact_prompt_gradient_with_blocks(name, block, split, monkeypatch):
    """A prompt that is not a multiple of the block size; responses cross block boundaries too.

    With ``split`` the mask-free attention runs for every node that has a cache, over every
    ancestor block as its own piece (query heads folded onto their key/value head)."""
    import forkrl.core.attention.split as attn

    monkeypatch.setattr(attn, "MIN_SPLIT_ELEMENTS", 0 if split else 1 << 62)
    monkeypatch.setattr(attn, "MIN_PIECE", 1)
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


class _CatSizes(torch.overrides.TorchFunctionMode):
    """Records the sequence length (dim -2) of every 4D tensor torch.cat makes."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.cat and isinstance(out, torch.Tensor) and out.dim() == 4:
            self.lengths.append(out.shape[-2])
        return out


@pytest.mark.parametrize("name", ["llama-gqa", "lfm2"])
def test_replay_never_copies_the_prompt_cache(name, monkeypatch):
    """Blocks and branches attend to the prompt's cache piece by piece: no tensor as long as the
    prompt is concatenated (a per-branch copy of the cache would double its memory)."""
    import forkrl.core.attention.split as attn

    monkeypatch.setattr(attn, "MIN_SPLIT_ELEMENTS", 0)
    monkeypatch.setattr(attn, "MIN_PIECE", 16)
    model = make_model(name, dtype=torch.float32)
    P, block = 200, 32
    seqs, sf, coefs = _long_group(P=P, G=3, R=8, vocab=model.config.vocab_size)
    forest = PrefixForest.build(seqs, sf)
    meter = _CatSizes()
    with meter:
        TreeExecutor(model, mode="replay", block_size=block).backward(forest, [c.float() for c in coefs])
    assert meter.lengths == [] or max(meter.lengths) < P // 2
    # Control: the model's own attention does concatenate the whole cache.
    meter = _CatSizes()
    with meter:
        TreeExecutor(model, mode="replay", block_size=block, split_attention=False).backward(
            forest, [c.float() for c in coefs]
        )
    assert max(meter.lengths) >= P


def test_attention_that_bypasses_the_cache_pieces_falls_back_or_is_refused(monkeypatch, caplog):
    """A model whose attention does not get the keys its cache returned would silently drop the
    ancestors' context: the first-use probe notices before any gradient changes, the pass falls back
    to the model's own attention where that agrees (one log line), and is refused where nothing does."""
    import forkrl.core.attention.split as attn
    from forkrl.core import UnsupportedModelError
    from forkrl.core.executor import cache

    monkeypatch.setattr(attn, "MIN_SPLIT_ELEMENTS", 0)

    def plain_update(self, key_states, value_states, *args, **kwargs):
        self.new_keys, self.new_values = key_states, value_states
        return key_states.clone(), value_states  # the pieces do not travel with a copy

    monkeypatch.setattr(cache.PiecewiseLayer, "update", plain_update)
    model = make_model("llama-gqa", dtype=torch.float32)
    seqs, sf, coefs = _long_group(P=40, G=2, R=4, vocab=model.config.vocab_size)
    forest = PrefixForest.build(seqs, sf)
    want, _ = dense_logprobs(model, seqs, sf)
    ex = TreeExecutor(model, mode="replay", block_size=8)
    with caplog.at_level("WARNING"):
        res = ex.backward(forest, coefs)
    assert "split attention disagrees" in caplog.text and not ex.split_attention
    assert max_rel_err(res.logprobs, [w.detach() for w in want]) < 1e-5
    # Nothing agrees: a cache that drops the ancestors' keys in every path is refused, nothing accumulated.
    monkeypatch.setattr(cache.RecordingLayer, "update", plain_update)
    model.zero_grad(set_to_none=True)
    with pytest.raises(UnsupportedModelError, match="cache contract"):
        TreeExecutor(model, mode="replay", block_size=8).backward(forest, coefs)
    assert all(p.grad is None for p in model.parameters())


def test_prompt_blocks_share_one_cache_buffer_and_one_gradient_buffer(monkeypatch):
    """The blocks of a long prompt keep their keys/values in one buffer per layer and accumulate
    their gradients into one more (per-block allocations would each cost a page of overhead)."""
    from forkrl.core.executor import TreeExecutor as Executor
    from forkrl.core.executor.dfs import DepthFirstPass

    seen = []
    real = DepthFirstPass._cache_leaves

    def recording(self, unit, kv, requires_grad):
        leaves = real(self, unit, kv, requires_grad)
        seen.append((unit.is_block, leaves))
        return leaves

    monkeypatch.setattr(DepthFirstPass, "_cache_leaves", recording)
    model = make_model("llama-gqa", dtype=torch.float32)
    seqs, sf, coefs = _long_group(P=50, G=2, R=4, vocab=model.config.vocab_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Executor(model, mode="replay", block_size=16).backward(
            PrefixForest.build(seqs, sf), [c.float() for c in coefs]
        )
    # Each block's gradient slice has its leaf's strides (autograd warns about slow accumulation otherwise).
    assert not [w for w in caught if "layout contract" in str(w.message)]
    blocks = [leaves for is_block, leaves in seen if is_block]
    assert len(blocks) == 4  # 50 prompt tokens in blocks of 16: 16, 16, 16, 2
    for layer in range(model.config.num_hidden_layers):
        for j in range(2):  # keys, values
            data = {b.layers[layer][j].untyped_storage().data_ptr() for b in blocks}
            grad = {b.layers[layer][j].grad.untyped_storage().data_ptr() for b in blocks}
            assert len(data) == 1 and len(grad) == 1
