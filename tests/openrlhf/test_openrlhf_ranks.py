"""Two gloo ranks under DeepSpeed ZeRO-2 and ZeRO-3: the ranks hold different forests (rank 0 GRPO
groups that share prompts, rank 1 rows that share nothing, so their trees have different numbers of
units) and forkrl's update still equals OpenRLHF's own on every rank. Nothing collective runs inside
a tree step (it trains an aliasing replica); ZeRO-2's reduction runs once per micro-batch, as in
stock, in the same order on every rank; ZeRO-3 gathers the partitions once per window and
reduce-scatters once. A hang fails by the timeout."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkrl.core.testing.ranks import rank_lines, torchrun

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import sys
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
from tests.openrlhf import harness as h
from tests.openrlhf.test_openrlhf_trainer import _agreement, _run
from forkrl.core.testing.ranks import finish, report
import forkrl.plugins.openrlhf.trainer as trainer_module
rows_after = []  # this rank's rows in each balanced window
def spy(*args, **kwargs):
    out, result = balance_window(*args, **kwargs)
    rows_after.append(sum(len(e.sequences) for e, _ in out))
    return out, result
balance_window, trainer_module.balance_window = trainer_module.balance_window, spy
rank = dist.get_rank()
g = torch.Generator().manual_seed(7)
rand = lambda n: torch.randint(0, 250, (n,), generator=g).tolist()
def rows(seed):
    if {skewed}:  # rank 0 long prompts, rank 1 short ones: the balancer has rows to move
        return h.rollouts(seed=seed, prompt=48 if rank == 0 else 8)
    if rank == 0:
        return h.rollouts(seed=seed)
    return [([k] + rand(5 + k % 3), rand(2 + k % 4)) for k in range(8)]  # nothing shared
rounds = [[h.experience(rows(10 * r + k), seed=100 * rank + 10 * r + k) for k in range(2)] for r in range(2)]
argv = h.command("unused", "--actor.entropy_coef", "0.01", "--forkrl.tree_packing", "--forkrl.tree_balance", {balance!r})
argv[argv.index("--ds.zero_stage") + 1] = {stage!r}
argv[argv.index("--actor.num_gpus_per_node") + 1] = "2"  # the two torchrun ranks
args = h.parse_args(argv)
stock, s_status = _run(args, tree=False, rounds=rounds, kl_ctl=0.0)
tree, t_status = _run(args, tree=True, rounds=rounds, kl_ctl=0.0)
change, rel = _agreement(stock, tree)
loss_s, loss_t = s_status[-1]["policy_loss"], t_status[-1]["policy_loss"]
moved = sum(s.get("tree/balance_moved_rows", 0.0) for s in t_status)
reward_s, reward_t = s_status[-1]["reward"], t_status[-1]["reward"]
counts = ",".join(map(str, rows_after)) or "-"
report(f"RANK {{rank}} REL {{rel:.3e}} CHANGE {{change:.3e}} LOSS {{loss_s:.6f}} {{loss_t:.6f}} GAS {{stock.strategy.accumulated_gradient}} MOVED {{moved:.1f}} REWARD {{reward_s:.6f}} {{reward_t:.6f}} ROWS {{counts}}")
finish()
"""


@pytest.mark.parametrize(
    "stage,balance,skewed",
    [("2", "off", False), ("3", "off", False), ("2", "auto", True), ("3", "on", True)],
    ids=["zero2", "zero3", "zero2-balanced", "zero3-balanced"],
)
def test_two_ranks_equal_stock(tmp_path, stage, balance, skewed):
    """With tree_balance each window's rows move between the ranks (rank 0 holds the long prompts):
    the update is still stock's, and so are the per-row figures (the reward); the logged policy loss,
    a token-weighted mean of per-micro-batch values, follows the new grouping, so it is compared
    only without balancing."""
    script = tmp_path / "ranks.py"
    script.write_text(_SCRIPT.format(root=str(ROOT), stage=stage, balance=balance, skewed=skewed))
    lines = rank_lines(torchrun(script, cwd=ROOT).stdout)
    assert len(lines) == 2, lines
    for line in lines:
        fields = line.split()
        assert float(fields[3]) < 1e-5 and float(fields[5]) > 1e-2, line
        assert fields[10] == "2", line  # 8 rows per step over 2 ranks of micro-batches of 2
        assert abs(float(fields[14]) - float(fields[15])) < 1e-5 * max(1.0, abs(float(fields[14]))), line
        if balance == "off":
            assert abs(float(fields[7]) - float(fields[8])) < 1e-5 * max(1.0, abs(float(fields[7]))), line
            assert float(fields[12]) == 0.0, line
        else:
            assert float(fields[12]) > 0, line  # rows did move
    if balance != "off":  # skewed windows: the plan changes the ranks' row counts (4 each before)
        rows = [[int(n) for n in line.split()[-1].split(",")] for line in lines]
        assert all(a + b == 8 for a, b in zip(*rows, strict=True)) and rows[0] != rows[1], rows
