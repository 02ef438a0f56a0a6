"""A forest's prompts split over a context-parallel group (ContextParallelExecutor), float64, 2 gloo ranks.

Every rank holds the same forest: two prompts (one with a longer scored span than its prompt, one
whose responses start scoring late), their responses of uneven lengths, and a third tree too short
to matter. Log-probs, entropies and the gradient of a functional with an entropy term must equal a
TreeExecutor's single-device long-context replay of the same forest to 1e-10, in both schedules.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.forests import late_scored_forest
from forkrl.core.testing.models import grads, max_rel_err, tiny_causal_lm
from forkrl.core.testing.ranks import run_on_ranks

pytestmark = pytest.mark.slow  # gloo ranks

TOL = 1e-10


def _forest() -> tuple[PrefixForest, list[torch.Tensor], list[torch.Tensor]]:
    return late_scored_forest(3, ((19, 4, 0), (12, 3, 2)))


def _rank(schedule: str) -> dict:
    from forkrl.core.executor.cp_executor import ContextParallelExecutor

    forest, coefs, ent_coefs = _forest()
    with Float64Mode():
        model = tiny_causal_lm("llama-gqa")
        single = TreeExecutor(model, mode="replay", block_size=4, prompt_grad="exact")
        want = single.backward(forest, grad_logprobs=coefs, grad_entropies=ent_coefs)
        reference = grads(model)
        model.zero_grad(set_to_none=True)
        cp = ContextParallelExecutor(model, block_size=3, schedule=schedule)
        scored = cp.score(forest, entropy=True)
        got = cp.backward(forest, grad_logprobs=coefs, grad_entropies=ent_coefs)
        err = max_rel_err(grads(model), reference)
    diff = lambda a, b: max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))  # noqa: E731
    return {
        "grad": err,
        "lp": diff(got.logprobs, want.logprobs),
        "ent": diff(got.entropies, want.entropies),
        "score_lp": diff(scored.logprobs, want.logprobs),
        "score_ent": diff(scored.entropies, want.entropies),
        "entries": float((got.entry_logprobs - want.entry_logprobs).abs().max()),
        "world": dist.get_world_size(),
    }


@pytest.mark.parametrize("schedule", ["parallel", "serial"])
def test_the_forest_over_two_ranks_equals_single_device_replay(schedule):
    for r in run_on_ranks(_rank, 2, schedule, timeout=180):
        assert r["world"] == 2
        assert r["grad"] < TOL, r
        for key in ("lp", "ent", "score_lp", "score_ent", "entries"):
            assert r[key] < 1e-12, r


def test_token_local_coefficients_routers_and_images_are_refused_with_the_alternative():
    from forkrl.core.executor.cp_executor import ContextParallelExecutor

    executor = ContextParallelExecutor.__new__(ContextParallelExecutor)
    with pytest.raises(ValueError, match="grad_logprobs"):
        ContextParallelExecutor.backward(executor, None, coefficient_fn=lambda *a: a)
    with pytest.raises(ValueError, match="router loss coefficient to 0"):
        ContextParallelExecutor._refuse(object(), None)
    with pytest.raises(ValueError, match="one device"):
        with executor.images(object()):
            pass


def _step_rank(kind: str) -> dict:
    """TreeStep with long_context_replay and a context-parallel group against plain autograd: a PPO-style
    loss (scored first) or a linear one with an entropy bonus (the fused path), padded TRL-style rows."""
    import contextlib

    from forkrl.core import RowLayout, TreeOptions, TreeStep
    from forkrl.core.testing.models import dense_logprobs, left_padded
    from forkrl.core.train import ParallelContext, StepLoss

    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(0, 61, (n,), generator=g).tolist()  # noqa: E731
    prompts = [rand(14), rand(9)]
    rows = [(prompts[i % 2], rand(1 + (3 * i) % 5)) for i in range(6)]
    ids, mask = left_padded(rows)
    P, C = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    layout, scored = RowLayout.padded(ids, mask, C), mask[:, P:].bool()
    adv = torch.randn(len(rows), 1, generator=g, dtype=torch.float64)
    old = torch.randn(layout.shape, generator=g, dtype=torch.float64) * 0.1 - 3

    def loss_fn(i, lp, ent):
        m = scored.to(lp.dtype)
        if kind == "linear":
            return -(adv * lp * m).sum() / m.sum() - 0.01 * (ent * m).sum() / m.sum()
        ratio = torch.exp(lp - old)
        return -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * m).sum() / m.sum()

    path = "constant" if kind == "linear" else "token_local"
    with Float64Mode():
        model = tiny_causal_lm("llama-gqa")
        lps, ents = dense_logprobs(model, [p + c for p, c in rows], [len(p) for p, _ in rows], entropy=True)
        want_loss = loss_fn(0, layout.to_host(torch.cat(lps)), layout.to_host(torch.cat(ents)))
        want_loss.backward()
        want = grads(model)
        model.zero_grad(set_to_none=True)
        step = TreeStep(TreeOptions(long_context_replay=True, tree_block_size=3))
        parallel = ParallelContext(context_parallel=dist.group.WORLD)
        res = step.train(model, [layout], StepLoss(loss_fn, path, quiet=contextlib.nullcontext), parallel)
        scored_lp, _ = step.score(model, layout, parallel=parallel)
    return {
        "grad": max_rel_err(grads(model), want),
        "loss": abs(float(res.loss) - float(want_loss)),
        "score": float(((scored_lp - layout.to_host(torch.cat(lps))) * scored).abs().max()),
        "path": res.objective.path,
    }


@pytest.mark.parametrize("kind, path", [("linear", "constant"), ("ppo", "general")])
def test_tree_step_with_a_context_parallel_group_equals_plain_autograd(kind, path):
    """Every rank of the group ends with the whole step's gradient (token-local losses are scored first)."""
    for r in run_on_ranks(_step_rank, 2, kind, timeout=180):
        assert r["grad"] < TOL, r
        assert r["loss"] < 1e-12 and r["score"] < 1e-12, r
        assert r["path"] == path, r


def _bf16_rank() -> dict:
    """The forest's gradient three ways on each rank: plain autograd in float32 (exact) and with
    bf16 weights (stock), and ContextParallelExecutor over the group with bf16 weights."""
    from forkrl.core.executor.cp_executor import ContextParallelExecutor
    from forkrl.core.testing import Bf16Rounding
    from forkrl.core.testing.models import dense_logprobs

    forest, coefs, _ = _forest()
    seqs = [forest.sequence_tokens(s).tolist() for s in range(forest.num_sequences)]
    flat = {}
    for name, dtype in (("exact", torch.float32), ("stock", torch.bfloat16), ("tree", torch.bfloat16)):
        model = tiny_causal_lm("llama-gqa", dtype=dtype)
        if name == "tree":
            ContextParallelExecutor(model, block_size=3).backward(forest, grad_logprobs=coefs)
        else:
            lps, _ = dense_logprobs(model, seqs, forest.score_from)
            sum((lp * c.to(lp.dtype)).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
        flat[name] = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    bf16 = Bf16Rounding("context parallel, bf16 weights", flat["tree"], flat["stock"], flat["exact"])
    return {"off": bf16.off, "near": bf16.near}


def test_bf16_weights_are_as_accurate_as_plain_autograd():
    """The precision users train in: with bf16 weights the group's gradient is no further from the
    float32 one than plain bf16 autograd's (the pack and merges run in float32)."""
    for r in run_on_ranks(_bf16_rank, 2, timeout=180):
        assert 0.5 <= r["off"] <= 1.5, r  # measured 0.97 (|tree - stock| 0.86 of the bf16 gap)


def test_a_model_the_group_cannot_split_is_refused_when_the_step_is_set_up():
    """Checked with the host's setup (TreeRunner.check_model), before any rollout: a sliding-window
    model under long_context_replay with a context-parallel group is refused naming single-device
    replay (hybrids are not: their state is carried chunk to chunk, tests/core/test_cp_hybrid.py)."""
    from forkrl.core import TreeOptions, TreeStep, UnsupportedModelError
    from forkrl.core.train import ParallelContext

    step = TreeStep(TreeOptions(long_context_replay=True))
    sliding = tiny_causal_lm("mistral-swa")
    step.check_model(sliding)  # one device: single-device replay runs sliding windows
    with pytest.raises(UnsupportedModelError, match=r"mode='replay', prompt_grad='exact'"):
        step.check_model(sliding, ParallelContext(context_parallel=object()))
    step.check_model(tiny_causal_lm("qwen3next"), ParallelContext(context_parallel=object()))
