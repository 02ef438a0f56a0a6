"""Context-parallel ranks that hold different rows (TRL's processes grouped): the group's union, float64.

Each rank has its own micro-batches (its own prompts and responses, its own loss normalisation).
A group of C ranks trains one forest of all their rows with every prompt split over the group;
each rank runs its loss on its own micro-batches only. After the data-parallel average over the
world, every rank's gradient must equal the average of the ranks' own-rows gradients computed by
plain autograd (stock data parallelism), to 1e-10; losses and scored values are each rank's own.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from forkrl.core.testing import Float64Mode
from forkrl.core.testing.models import grads, max_rel_err, tiny_causal_lm
from forkrl.core.testing.ranks import run_on_ranks

pytestmark = pytest.mark.slow  # gloo ranks

TOL = 1e-10


def _rows(rank: int, micro: int):
    """Rank ``rank``'s micro-batch ``micro``: (layout, scored mask, advantages, old log-probs, rows)."""
    from forkrl.core import RowLayout
    from forkrl.core.testing.models import left_padded

    g = torch.Generator().manual_seed(100 * rank + micro)
    rand = lambda n: torch.randint(0, 61, (n,), generator=g).tolist()  # noqa: E731
    prompt = rand(11 + 3 * rank + micro)  # P not divisible by C, different per rank
    rows = [(prompt, rand(1 + (3 * i + rank) % 5)) for i in range(3 + rank % 2)]
    ids, mask = left_padded(rows)
    P, C = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    layout = RowLayout.padded(ids, mask, C)
    adv = torch.randn(len(rows), 1, generator=g, dtype=torch.float64)
    old = torch.randn(layout.shape, generator=g, dtype=torch.float64) * 0.1 - 3
    return layout, mask[:, P:].bool(), adv, old, rows


def _loss(batch, lp, ent):
    """A PPO-style clipped loss with an entropy bonus, normalised over the micro-batch's own tokens."""
    _, scored, adv, old, _ = batch
    m = scored.to(lp.dtype)
    ratio = torch.exp(lp - old)
    pg = -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * m).sum() / m.sum()
    return pg - 0.01 * (ent * m).sum() / m.sum()


def _union_rank(cp: int, poison: bool = False) -> dict:
    from forkrl.core import TreeOptions, TreeStep
    from forkrl.core.testing.models import dense_logprobs
    from forkrl.core.train import ParallelContext, StepLoss

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(s, s + cp))) for s in range(0, world, cp)]
    batches = {(r, k): _rows(r, k) for r in range(world) for k in range(2)}
    mine = [batches[rank, k] for k in range(2)]
    with Float64Mode():
        model = tiny_causal_lm("llama-gqa")
        for batch in batches.values():  # stock: each rank's own loss, averaged over the world
            layout, _, _, _, rows = batch
            lps, ents = dense_logprobs(
                model, [p + c for p, c in rows], [len(p) for p, _ in rows], entropy=True
            )
            loss = _loss(batch, layout.to_host(torch.cat(lps)), layout.to_host(torch.cat(ents)))
            (loss / world).backward()
        want = grads(model)
        own_lp = [dense_logprobs(model, [p + c for p, c in b[4]], [len(p) for p, _ in b[4]])[0] for b in mine]
        model.zero_grad(set_to_none=True)

        def loss_fn(i, lp, ent):
            value = _loss(mine[i], lp, ent)
            return value * float("nan") if poison and rank == world - 1 else value

        step = TreeStep(TreeOptions(long_context_replay=True, tree_block_size=3))
        parallel = ParallelContext(
            group=None,
            average_gradients=True,
            context_parallel=groups[rank // cp],
            context_parallel_rows="own",
        )
        step.check_model(model, parallel)
        layouts = [b[0] for b in mine]
        if poison:
            try:
                step.train(
                    model, layouts, StepLoss(loss_fn, "general", quiet=contextlib.nullcontext), parallel
                )
            except ValueError as err:
                return {
                    "refused": str(err),
                    "grads": [p.grad for p in model.parameters() if p.grad is not None],
                }
            return {"refused": None}
        res = step.train(model, layouts, StepLoss(loss_fn, "general", quiet=contextlib.nullcontext), parallel)
        scored = step.score_window(model, layouts, parallel=parallel)
        want_losses = [float(_loss(b, *_host_values(model, b))) for b in mine]
    score_err = max(
        float(((lp - b[0].to_host(torch.cat(ref))) * b[1]).abs().max())
        for (lp, _), b, ref in zip(scored, mine, own_lp, strict=True)
    )
    return {
        "grad": max_rel_err(grads(model), want),
        "losses": max(abs(float(a) - b) for a, b in zip(res.losses, want_losses, strict=True)),
        "count": len(res.losses),
        "score": score_err,
        "unique": res.metrics.unique_tokens,
        "forest": res.forest.unique_tokens,
    }


def _host_values(model, batch):
    """``batch``'s log-probs and entropies by plain autograd, in its layout."""
    from forkrl.core.testing.models import dense_logprobs

    layout, _, _, _, rows = batch
    with torch.no_grad():
        lps, ents = dense_logprobs(model, [p + c for p, c in rows], [len(p) for p, _ in rows], entropy=True)
    return layout.to_host(torch.cat(lps)), layout.to_host(torch.cat(ents))


@pytest.mark.parametrize("world, cp", [(2, 2), (4, 2), (4, 4)])
def test_a_group_of_ranks_with_their_own_rows_equals_data_parallel_autograd(world, cp):
    """The union's gradient, each rank's share averaged over the world, is stock data parallelism's;
    each rank's losses and scored log-probs are its own rows'; each reports 1/C of the union's tokens."""
    for r in run_on_ranks(_union_rank, world, cp, timeout=300):
        assert r["grad"] < TOL, r
        assert r["losses"] < 1e-12 and r["count"] == 2 and r["score"] < 1e-12, r
        assert abs(r["unique"] * cp - r["forest"]) < 1e-9, r


def test_a_non_finite_loss_on_one_rank_is_refused_on_every_rank_before_any_pass():
    """One rank's NaN loss: every rank of the group refuses the step, and nothing was accumulated."""
    for r in run_on_ranks(_union_rank, 2, 2, True, timeout=180):
        assert r["refused"] is not None and "NaN" in r["refused"], r
        assert r["grads"] == [], r
