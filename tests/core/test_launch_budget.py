"""Budgets of what a tree pass asks of a GPU, counted on the CPU (``benchmarks/launch_budget.py``
prints them at full size): at the Qwen2.5-0.5B structure (4 of its 24 layers and shorter
sequences here, for time: launches depend on the forest's shape and the depth, not the lengths)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.launch_budget import qwen_05b_structure, rollouts
from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.testing.dispatch import count_call, count_dense

pytestmark = pytest.mark.slow  # counts every op of full passes at the 24-layer shapes

SHAPES = {"one": (1, 128, 16, 16), "math": (32, 32, 8, 8)}  # (groups, P, G, R)


@pytest.fixture(scope="module")
def model():
    return qwen_05b_structure(layers=4)


_BATCHES: dict = {}


def _batch(model, shape: str):
    """(shape, forest, per-sequence coefficients, the plain computation's counts), built once."""
    if shape not in _BATCHES:
        seqs, score_from = rollouts(*SHAPES[shape])
        forest = PrefixForest.build(seqs, score_from)
        coefs = [torch.ones(len(s) - a) for s, a in zip(seqs, score_from, strict=True)]
        _BATCHES[shape] = shape, forest, coefs, count_dense(model, seqs, score_from, micro_batch=8)
    return _BATCHES[shape]


@pytest.fixture(scope="module", params=list(SHAPES))
def batch(request, model):
    return _batch(model, request.param)


_COUNTED: dict = {}


def _counted(model, shape: str, **options):
    """A verified executor with ``options`` and the counts of its second gradient call at ``shape``
    (the first builds its kernels' checks): counted once for the tests that ask for the same one."""
    key = (shape, tuple(sorted(options.items())))
    if key not in _COUNTED:
        _, forest, coefs, _ = _batch(model, shape)
        ex = TreeExecutor(model, **options).verify()
        ex.backward(forest, coefs)
        _COUNTED[key] = ex, count_call(ex, lambda: ex.backward(forest, coefs))
    return _COUNTED[key]


@pytest.mark.parametrize(  # replay's many short decoder runs at the math shape add time, not code
    "shape,mode",
    [("one", "keep"), ("one", "replay"), ("one", "packed"), ("math", "keep"), ("math", "packed")],
)
def test_a_pass_never_waits_for_the_device(model, shape, mode):
    """No synchronising op and no host-device move inside a pass, gradient or scoring: every index
    is staged before it with one copy. The one read of the whole call is the coefficients' NaN
    check, before the pass (a NaN advantage is refused with nothing accumulated)."""
    _, forest, _, _ = _batch(model, shape)
    ex, grad = _counted(model, shape, mode=mode)
    score = count_call(ex, lambda: ex.score(forest, entropy=True))
    assert (grad.syncs, grad.moves, grad.call_syncs) == (0, 0, 1), grad
    assert (score.syncs, score.moves, score.call_syncs) == (0, 0, 0), score
    model.zero_grad(set_to_none=True)


def test_kernel_launches_against_the_plain_computation(model, batch):
    """Non-view ATen ops and decoder runs of one gradient call against the plain computation's
    (micro-batches of 8). Packed mode runs one forward of the whole forest. Keep mode runs the
    units at one depth of all trees as one forward: one decoder run per depth (the depth-first pass
    ran about two per group); at many groups it launches a fraction of the plain
    computation's ops; at one group (as many runs as the plain computation's two micro-batches) its
    split attention's second kernel and merge cost about a tenth more."""
    shape, _, _, dense = batch
    counts = {}
    for name, options in {
        "keep": {"collapse_tokens": 64},
        "depth-first": {"level_batching": False},
        "packed": {"mode": "packed"},  # as test_a_pass_never_waits_for_the_device counted it
    }.items():
        counts[name] = _counted(model, shape, **options)[1]
    model.zero_grad(set_to_none=True)
    assert counts["packed"].ops <= dense.ops, (counts, dense)
    assert counts["packed"].decoder_runs == 1
    assert counts["keep"].ops <= counts["depth-first"].ops, (counts, dense)
    # One decoder run per depth: the prompts, then the completions (the few completions that share
    # a first token carry it themselves rather than adding a depth).
    assert counts["keep"].decoder_runs == 2, counts
    if shape == "math":  # 32 groups
        assert counts["keep"].ops <= 0.25 * dense.ops, (counts, dense)
    else:
        assert counts["keep"].ops <= 1.15 * dense.ops, (counts, dense)
