"""The tree step under real FSDP2 (``fully_shard`` per decoder layer and on the root), 2 gloo ranks.

Each rank holds a different forest (rank 0: one long shared-prompt group; rank 1: short sequences
with no shared prefix at all, a different number of units), so a step that issued collectives
per unit would hang or mix layers up. The sharded gradients must equal the average over ranks of
plain dense gradients in true float64, scoring must equal dense scoring, and a failure on one rank
must stop both ranks instead of leaving one waiting. Every run has a timeout: a hang fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forkrl.core.testing.ranks import rank_lines, torchrun

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from forkrl.core import RowLayout, TreeOptions, TreeStep
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err, tiny_causal_lm
from forkrl.core.testing.ranks import finish, report

case = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

g = torch.Generator().manual_seed(100 + rank)
rand = lambda n: torch.randint(0, 61, (n,), generator=g).tolist()
if rank == 0:  # one group: a long prompt, completions that share openings
    prompt = rand(24)
    rows = [(prompt, rand(3) + rand(1 + k)) for k in range(4)]
else:  # nothing shared: every sequence starts with its own token
    rows = [([k] + rand(2 + k), rand(2)) for k in range(6)]
seqs = [p + c for p, c in rows]
P, C = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
ids = torch.zeros(len(rows), P + C, dtype=torch.long)
mask = torch.zeros_like(ids)
for b, (p, c) in enumerate(rows):
    ids[b, P - len(p):P], mask[b, P - len(p):P] = torch.tensor(p), 1
    ids[b, P:P + len(c)], mask[b, P:P + len(c)] = torch.tensor(c), 1
layout = RowLayout.padded(ids, mask, C)
cmask = mask[:, P:].to(torch.float64)
adv = torch.randn(len(rows), 1, generator=g, dtype=torch.float64)
old = torch.randn(len(rows), C, generator=g, dtype=torch.float64) * 0.1 - 3

def loss_fn(i, lp, ent):
    if case == "nan" and rank == 1:
        return (lp * cmask).sum() * float("nan")
    ratio = torch.exp(lp - old)
    return -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * cmask).sum() / cmask.sum() - 0.01 * (ent * cmask).sum()

with Float64Mode():
    reference = tiny_causal_lm("llama-gqa", tie_word_embeddings=(case == "tied"))
    model = tiny_causal_lm("llama-gqa", tie_word_embeddings=(case == "tied"))
    reference.train(); model.train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    lps, ents = dense_logprobs(reference, seqs, [len(p) for p, _ in rows], entropy=True)
    (loss_fn(0, layout.to_host(torch.cat(lps)), layout.to_host(torch.cat(ents))) / world).backward()
    want = grads(reference)
    for w in want:
        dist.all_reduce(w)
    step = TreeStep(TreeOptions(tree_packing=True, tree_mode="replay" if case == "replay" else "auto", tree_block_size=5 if case == "replay" else None))
    raised = None
    try:
        scored, _ = step.score(model, layout)
        res = step.train(model, [layout], loss_fn, loss_gradient="general")
    except (ValueError, RuntimeError) as error:
        # Only the message is kept: the traceback's frames (autograd graphs over the gathered
        # replica) are freed here, while the process group is alive, not at interpreter exit.
        raised = f"{type(error).__name__}: {error}"
    if raised is not None:
        untouched = all(p.grad is None for p in model.parameters())
        lines = [f"RANK {rank} RAISED {raised}", f"RANK {rank} UNTOUCHED {untouched}"]
    else:
        got = [p.grad.full_tensor() for p in model.parameters()]
        err = max_rel_err(got, want)
        dense_scored = layout.to_host(torch.cat([t.detach() for t in lps]))
        score_err = (scored - dense_scored).abs().max().item()
        lines = [f"RANK {rank} GRAD_ERR {err:.3e} SCORE_ERR {score_err:.3e} UNITS {res.forest.num_sequences}"]
report(*lines)
finish()
"""


def _torchrun(tmp_path, case: str) -> str:
    script = tmp_path / "sharded.py"
    script.write_text(_SCRIPT)
    return torchrun(script, case, timeout=300, cwd=ROOT).stdout


@pytest.mark.parametrize("case", ["keep", "replay", "tied"])
def test_fsdp2_tree_step_equals_the_average_of_dense_gradients(case, tmp_path):
    out = _torchrun(tmp_path, case)
    lines = rank_lines(out)
    assert len(lines) == 2, out
    for line in lines:
        fields = line.split()
        assert float(fields[3]) < 1e-10, line  # GRAD_ERR: the sharded gradient, gathered
        assert float(fields[5]) < 1e-12, line  # SCORE_ERR: prefix-shared scoring under FSDP2


def test_a_failure_on_one_rank_stops_both_without_a_hang(tmp_path):
    out = _torchrun(tmp_path, "nan")
    assert "RANK 1 RAISED ValueError: the loss is nan" in out, out
    assert "RANK 0 RAISED RuntimeError: another data-parallel rank stopped this step" in out, out
    assert "RANK 0 UNTOUCHED True" in out and "RANK 1 UNTOUCHED True" in out, out
