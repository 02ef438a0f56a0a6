"""Context-parallel replay of hybrid models (linear attention, Mamba-2 and Mamba-1 state beside
attention) on 2 and 4 gloo ranks, float64.

The state layers carry their conv/recurrent state from chunk to chunk in position order
(:mod:`forkrl.core.executor.cp_state`), forward and, in the reverse replay, its gradient back. The
whole-group parameter gradient every rank ends with, and each rank's log-probs, must equal
single-device long-context replay and plain per-sequence autograd of the same prompt and GRPO group
(8 responses) to 1e-10, with a prompt that does not split evenly over the ranks, blocks inside the
chunks (and of one token), and responses spread unevenly (a rank with none still issues every
collective).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.forests import late_scored_forest
from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err, tiny_causal_lm
from forkrl.core.testing.ranks import run_on_ranks

pytestmark = pytest.mark.slow  # several gloo ranks per test

TOL = 1e-10


def _hybrid_rank(name: str, P: int, block: int | None, prompt_grad: str, skewed: bool, schedule: str) -> dict:
    """One rank: the errors of its whole-group gradient and log-probs against single-device replay
    and plain autograd, and what its pass carried."""
    from forkrl.core.executor.context_parallel import ContextParallelReplay

    rank, world = dist.get_rank(), dist.get_world_size()
    G = 8
    g = torch.Generator().manual_seed(11)
    with Float64Mode():
        model = tiny_causal_lm(name)
        vocab = model.config.vocab_size
        prompt = torch.randint(0, vocab, (P,), generator=g).tolist()
        responses = [torch.randint(0, vocab, (2 + i % 4,), generator=g).tolist() for i in range(G)]
        coefs = [torch.randn(len(r), generator=g, dtype=torch.float64) for r in responses]
        owners = [0] * 5 + [min(2, world - 1)] * 2 + [world - 1] if skewed else [i % world for i in range(G)]
        mine = [i for i in range(G) if owners[i] == rank]
        seqs = [prompt + r for r in responses]
        lps, _ = dense_logprobs(model, seqs, [P] * G)
        sum((lp * c).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
        dense = grads(model)
        model.zero_grad(set_to_none=True)
        TreeExecutor(model, mode="replay", block_size=block or 64, prompt_grad=prompt_grad).backward(
            PrefixForest.build(seqs, [P] * G), coefs
        )
        replay = grads(model)
        if prompt_grad == "none":  # the truncated gradient is single-device replay's definition
            dense = replay
        model.zero_grad(set_to_none=True)
        cp = ContextParallelReplay(model, block_size=block, prompt_grad=prompt_grad, schedule=schedule)
        res = cp.backward(prompt, [responses[i] for i in mine], [coefs[i] for i in mine])
        got = grads(model)
        scored = cp.score(prompt, [responses[i] for i in mine])
    want = [lps[i].detach() for i in mine]
    return {
        "replay": max_rel_err(got, replay),
        "dense": max_rel_err(got, dense),
        "lp": max_rel_err(res.logprobs, want) if mine else 0.0,
        "score": max_rel_err(scored.logprobs, want) if mine else 0.0,
        "schedule": cp.schedule,
    }


@pytest.mark.parametrize(
    "nproc, name, P, block, prompt_grad, skewed, schedule",
    [
        (2, "qwen3next", 23, 4, "exact", False, "serial"),  # linear attention + attention; 22 cached: 11 + 11
        (4, "qwen3next", 26, 3, "exact", True, "parallel"),  # 25 over 4: 7+6+6+6; responses 5+0+2+1
        (2, "falconh1", 21, None, "exact", True, "serial"),  # attention and Mamba-2 in every layer
        (4, "bamba", 19, 1, "exact", False, "serial"),  # Mamba-2 + attention layers; blocks of one token
        (2, "jamba", 17, 3, "exact", False, "serial"),  # Mamba-1 (scanned from the carried state) + MoE
        (2, "lfm2", 20, 5, "exact", True, "serial"),  # short convolutions (conv state only) + attention
        (2, "mamba2", 15, 2, "exact", False, "serial"),  # a pure SSM: no attention, no position ids
        (2, "mamba", 13, 3, "exact", True, "serial"),  # pure Mamba-1
        (4, "qwen3next", 22, 4, "none", False, "serial"),  # truncated: the prompt's state a constant
    ],
)
def test_hybrid_context_parallel_replay_equals_single_device(
    nproc, name, P, block, prompt_grad, skewed, schedule
):
    ranks = run_on_ranks(_hybrid_rank, nproc, name, P, block, prompt_grad, skewed, schedule, timeout=300)
    for r in ranks:
        assert r["replay"] < TOL, r
        assert r["dense"] < TOL, r
        assert r["lp"] < TOL, r
        assert r["score"] < TOL, r
        assert r["schedule"] == "serial", r  # "parallel" falls back, logged: the state runs in order


def test_the_parallel_schedule_falls_back_to_serial_for_hybrids_logged(caplog):
    from forkrl.core.executor.context_parallel import ContextParallelReplay

    with caplog.at_level("INFO", logger="forkrl.core.executor.cp_state"):
        cp = ContextParallelReplay(tiny_causal_lm("qwen3next"))  # schedule="parallel" by default
    assert cp.schedule == "serial"
    assert "schedule='serial'" in caplog.text and "Qwen3Next" in caplog.text
    assert ContextParallelReplay(tiny_causal_lm("llama-gqa")).schedule == "parallel"


def _forest_rank(name: str) -> dict:
    """A forest of two prompts (one scoring late) through ContextParallelExecutor, with an entropy
    term, against single-device long-context replay of the same forest."""
    from forkrl.core.executor.cp_executor import ContextParallelExecutor

    forest, coefs, ent_coefs = late_scored_forest(5, ((17, 4, 0), (11, 3, 2)))
    with Float64Mode():
        model = tiny_causal_lm(name)
        want = TreeExecutor(model, mode="replay", block_size=4, prompt_grad="exact").backward(
            forest, grad_logprobs=coefs, grad_entropies=ent_coefs
        )
        reference = grads(model)
        model.zero_grad(set_to_none=True)
        got = ContextParallelExecutor(model, block_size=3).backward(
            forest, grad_logprobs=coefs, grad_entropies=ent_coefs
        )
        err = max_rel_err(grads(model), reference)
    return {
        "grad": err,
        "lp": max_rel_err(list(got.logprobs), list(want.logprobs)),
        "ent": max_rel_err(list(got.entropies), list(want.entropies)),
    }


def test_a_hybrid_forest_through_the_context_parallel_executor_equals_single_device():
    for r in run_on_ranks(_forest_rank, 2, "falconh1", timeout=300):
        assert r["grad"] < TOL and r["lp"] < TOL and r["ent"] < TOL, r
