"""The tree step under real FSDP2 (``fully_shard`` per decoder layer and on the root), 2 gloo ranks.

Each rank holds a different forest (rank 0: one long shared-prompt group; rank 1: short sequences
with no shared prefix at all, a different number of units), so a step that issued collectives
per unit would hang or mix layers up. The sharded gradients must equal the average over ranks of
plain dense gradients in true float64, scoring must equal dense scoring, and a failure on one rank
must stop both ranks instead of leaving one waiting. Every run has a timeout: a hang fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from forkrl.core import RowLayout, TreeOptions, TreeStep
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.models import dense_logprobs, grads, left_padded, max_rel_err, tiny_causal_lm
from forkrl.core.testing.ranks import run_on_ranks

pytestmark = pytest.mark.slow  # FSDP2 on two gloo ranks


def _rows(rank: int, g: torch.Generator) -> list[tuple[list[int], list[int]]]:
    def rand(n: int) -> list[int]:
        return torch.randint(0, 61, (n,), generator=g).tolist()

    if rank == 0:  # one group: a long prompt, completions that share openings
        prompt = rand(24)
        return [(prompt, rand(3) + rand(1 + k)) for k in range(4)]
    return [([k] + rand(2 + k), rand(2)) for k in range(6)]  # nothing shared: each its own first token


def _sharded_step(case: str) -> dict:
    """One rank's tree step under FSDP2 against the average of dense gradients (float64): its errors,
    or, when the step raised, the error and whether the parameters were left untouched."""
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)
    rows = _rows(rank, g)
    seqs = [p + c for p, c in rows]
    P, C = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids, mask = left_padded(rows)
    layout = RowLayout.padded(ids, mask, C)
    cmask = mask[:, P:].to(torch.float64)
    adv = torch.randn(len(rows), 1, generator=g, dtype=torch.float64)
    old = torch.randn(len(rows), C, generator=g, dtype=torch.float64) * 0.1 - 3

    def loss_fn(i, lp, ent):
        if case == "nan" and rank == 1:
            return (lp * cmask).sum() * float("nan")
        ratio = torch.exp(lp - old)
        clipped = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        return -(clipped * cmask).sum() / cmask.sum() - 0.01 * (ent * cmask).sum()

    with Float64Mode():
        reference = tiny_causal_lm("llama-gqa", tie_word_embeddings=(case == "tied"))
        model = tiny_causal_lm("llama-gqa", tie_word_embeddings=(case == "tied"))
        reference.train()
        model.train()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        lps, ents = dense_logprobs(reference, seqs, [len(p) for p, _ in rows], entropy=True)
        (loss_fn(0, layout.to_host(torch.cat(lps)), layout.to_host(torch.cat(ents))) / world).backward()
        want = grads(reference)
        for w in want:
            dist.all_reduce(w)
        replay = case == "replay"
        step = TreeStep(
            TreeOptions(
                tree_packing=True,
                tree_mode="replay" if replay else "auto",
                tree_block_size=5 if replay else None,
            )
        )
        raised = None
        try:
            scored, _ = step.score(model, layout)
            res = step.train(model, [layout], loss_fn)
        except (ValueError, RuntimeError) as error:
            # Only the message is kept: the traceback's frames (autograd graphs over the gathered
            # replica) are freed here, while the process group is alive, not at interpreter exit.
            raised = f"{type(error).__name__}: {error}"
        if raised is not None:
            return {"raised": raised, "untouched": all(p.grad is None for p in model.parameters())}
        got = [p.grad.full_tensor() for p in model.parameters()]
        dense_scored = layout.to_host(torch.cat([t.detach() for t in lps]))
        return {
            "grad_err": max_rel_err(got, want),
            "score_err": (scored - dense_scored).abs().max().item(),
            "units": res.forest.num_sequences,
        }


@pytest.mark.parametrize("case", ["keep", "replay", "tied"])
def test_fsdp2_tree_step_equals_the_average_of_dense_gradients(case):
    ranks = run_on_ranks(_sharded_step, 2, case, timeout=300)
    for rank in ranks:
        assert rank["grad_err"] < 1e-10, rank  # the sharded gradient, gathered
        assert rank["score_err"] < 1e-12, rank  # prefix-shared scoring under FSDP2


def test_a_failure_on_one_rank_stops_both_without_a_hang():
    ranks = run_on_ranks(_sharded_step, 2, "nan", timeout=300)
    assert ranks[1]["raised"].startswith("ValueError: the loss is nan"), ranks
    assert ranks[0]["raised"].startswith("RuntimeError: another data-parallel rank stopped this step"), ranks
    assert ranks[0]["untouched"] and ranks[1]["untouched"], ranks
