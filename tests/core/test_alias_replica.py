"""AliasReplica: the tree step on a replica aliasing the model's parameters (as under DeepSpeed
ZeRO 0-2), its gradient handed over by one backward of the surrogate, in true float64.

The model's parameters carry gradient hooks, as an engine's reduction hooks would: none may fire
during the tree's backwards (DeepSpeed ZeRO refuses a parameter reduced twice per micro-step), and
each fires once for the surrogate. The handed-over gradient must equal plain autograd's.
"""

from __future__ import annotations

import pytest
import torch

from forkrl.core import RowLayout, TreeOptions, TreeStep
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.models import dense_logprobs, grads, left_padded, max_rel_err, tiny_causal_lm
from forkrl.core.train import AliasReplica


def _rows():
    g = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(0, 61, (n,), generator=g).tolist()  # noqa: E731
    prompt = rand(14)
    rows = [(prompt, rand(2 + k)) for k in range(4)] + [(rand(5), rand(3))]
    P, C = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids, mask = left_padded(rows)
    return rows, RowLayout.padded(ids, mask, C), mask[:, P:].to(torch.float64)


@pytest.mark.parametrize("tied", [False, True])
def test_alias_replica_hands_over_the_exact_gradient_without_firing_hooks(tied):
    rows, layout, cmask = _rows()
    old = torch.linspace(-3.2, -2.8, cmask.numel(), dtype=torch.float64).reshape(cmask.shape)

    def loss_fn(i, lp, ent):
        ratio = torch.exp(lp - old)
        return -(ratio.clamp(0.8, 1.2) * ratio * cmask).sum() / cmask.sum() - 0.01 * (ent * cmask).sum()

    with Float64Mode():
        reference = tiny_causal_lm("llama-gqa", tie_word_embeddings=tied)
        model = tiny_causal_lm("llama-gqa", tie_word_embeddings=tied)
        reference.train()
        model.train()
        lps, ents = dense_logprobs(
            reference, [p + c for p, c in rows], [len(p) for p, _ in rows], entropy=True
        )
        loss_fn(0, layout.to_host(torch.cat(lps)), layout.to_host(torch.cat(ents))).backward()
        want = grads(reference)

        fired: list[int] = []
        for k, p in enumerate(model.parameters()):
            p.register_hook(lambda g, k=k: fired.append(k) or g)
        replica = AliasReplica(model)
        step = TreeStep(TreeOptions(tree_packing=True))
        with replica.gathered(grad=True) as plain:
            assert all(
                a.data_ptr() == b.data_ptr()
                for a, b in zip(plain.parameters(), model.parameters(), strict=True)
            )
            step.train(plain, [layout], loss_fn)
        assert fired == [] and all(p.grad is None for p in model.parameters())
        replica.gradient_surrogate().backward()
        assert sorted(fired) == list(range(len(list(model.parameters()))))
        assert max_rel_err(grads(model), want) < 1e-12

        replica.clear()
        before = grads(model)
        replica.gradient_surrogate(zero=True).backward()
        assert max_rel_err(grads(model), before) == 0.0
        # Between steps the replica holds no parameters of its own (meta placeholders).
        assert all(p.is_meta for p in replica.replica.parameters())


def test_wider_accumulation_keeps_every_unit_once():
    """accumulate_dtype: each unit's gradient goes into a wider buffer as autograd produces it (none
    lost, none counted twice), and the surrogate rounds the sum to the parameter dtype once."""
    rows, layout, cmask = _rows()

    def loss_fn(i, lp, ent):
        return -(lp * cmask).sum() / cmask.sum() - 0.01 * (ent * cmask).sum()

    results = {}
    for wide in (None, torch.float64):
        model = tiny_causal_lm("llama-gqa").float()
        model.train()
        replica = AliasReplica(model, accumulate_dtype=wide)
        with replica.gathered(grad=True) as plain:
            TreeStep(TreeOptions(tree_packing=True)).train(plain, [layout], loss_fn)
            if wide is not None:
                assert all(p.grad is None for p in plain.parameters())  # moved into the wide buffers
        assert all(g.dtype == (wide or torch.float32) for g in replica.grads.values())
        replica.gradient_surrogate().backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        results[wide] = grads(model)
    assert max_rel_err(results[torch.float64], results[None]) < 1e-6


def test_partitioned_parameters_need_the_engines_gather_and_gather_once():
    """Parameters marked as ZeRO-3 partitions (``ds_id``; the real ones are tested with DeepSpeed in
    tests/trl/test_trl_deepspeed.py and tests/openrlhf): no gather is refused; ``whole`` gathers
    once however deeply nested; the surrogate needs them whole, and its zero form reaches none."""
    import contextlib

    model = tiny_causal_lm(seed=1)
    for i, p in enumerate(model.parameters()):
        p.ds_id, p.ds_shape = i, p.shape
    with pytest.raises(ValueError, match="ZeRO-3 partitions: pass gather="):
        AliasReplica(model)
    calls = []

    @contextlib.contextmanager
    def gather(params):
        calls.append(len(params))
        yield

    replica = AliasReplica(model, gather=gather)
    with replica.whole(), replica.gathered(grad=False), replica.whole():
        pass
    assert calls == [len(list(model.parameters()))]
    with pytest.raises(RuntimeError, match="inside AliasReplica.whole"):
        replica.gradient_surrogate()
    zero = replica.gradient_surrogate(zero=True)
    zero.backward()
    assert all(p.grad is None for p in model.parameters())
