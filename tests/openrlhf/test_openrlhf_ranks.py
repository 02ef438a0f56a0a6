"""Two gloo ranks under DeepSpeed ZeRO-2 and ZeRO-3: the ranks hold different forests (rank 0 GRPO
groups that share prompts, rank 1 rows that share nothing, so their trees have different numbers of
units) and forkrl's update still equals OpenRLHF's own on every rank. Nothing collective runs inside
a tree step (it trains an aliasing replica); ZeRO-2's reduction runs once per micro-batch, as in
stock, in the same order on every rank; ZeRO-3 gathers the partitions once per window and
reduce-scatters once. A hang fails by the timeout."""

from __future__ import annotations

import pytest

from forkrl.core.testing.ranks import run_on_ranks


def _two_rank_run(stage: str, balance: str, skewed: bool) -> dict:
    """One rank of stock OpenRLHF and forkrl's trainer on two rounds of this rank's experiences:
    their agreement, last losses and rewards, OpenRLHF's accumulation steps, the rows the balancer
    moved, and this rank's row count in each balanced window."""
    import torch
    import torch.distributed as dist

    import forkrl.plugins.openrlhf.trainer as trainer_module
    from forkrl.plugins.openrlhf import testing as h

    rows_after = []  # this rank's rows in each balanced window
    balance_window = trainer_module.balance_window

    def spy(*args, **kwargs):
        out, result = balance_window(*args, **kwargs)
        rows_after.append(sum(len(e.sequences) for e, _ in out))
        return out, result

    trainer_module.balance_window = spy
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return torch.randint(0, 250, (n,), generator=g).tolist()

    def rows(seed):
        if skewed:  # rank 0 long prompts, rank 1 short ones: the balancer has rows to move
            return h.rollouts(seed=seed, prompt=48 if rank == 0 else 8)
        if rank == 0:
            return h.rollouts(seed=seed)
        return [([k] + rand(5 + k % 3), rand(2 + k % 4)) for k in range(8)]  # nothing shared

    rounds = [
        [h.experience(rows(10 * r + k), seed=100 * rank + 10 * r + k) for k in range(2)] for r in range(2)
    ]
    argv = h.command(
        "unused", "--actor.entropy_coef", "0.01", "--forkrl.tree_packing", "--forkrl.tree_balance", balance
    )
    argv[argv.index("--ds.zero_stage") + 1] = stage
    argv[argv.index("--actor.num_gpus_per_node") + 1] = "2"  # the two ranks
    args = h.parse_args(argv)
    stock, s_status = h.train(args, rounds=rounds, forkrl=False, kl_ctl=0.0)
    tree, t_status = h.train(args, rounds=rounds, forkrl=True, kl_ctl=0.0)
    change, rel = h.agreement(stock, tree)
    return {
        "rel": rel,
        "change": change,
        "loss": (s_status[-1]["policy_loss"], t_status[-1]["policy_loss"]),
        "gas": stock.strategy.accumulated_gradient,
        "moved": sum(s.get("tree/balance_moved_rows", 0.0) for s in t_status),
        "reward": (s_status[-1]["reward"], t_status[-1]["reward"]),
        "rows": rows_after,
    }


@pytest.mark.parametrize(
    "stage,balance,skewed",
    [("2", "off", False), ("3", "off", False), ("2", "auto", True), ("3", "on", True)],
    ids=["zero2", "zero3", "zero2-balanced", "zero3-balanced"],
)
def test_two_ranks_equal_stock(stage, balance, skewed):
    """With tree_balance each window's rows move between the ranks (rank 0 holds the long prompts):
    the update is still stock's, and so are the per-row figures (the reward); the logged policy loss,
    a token-weighted mean of per-micro-batch values, follows the new grouping, so it is compared
    only without balancing."""
    ranks = run_on_ranks(_two_rank_run, 2, stage, balance, skewed)
    for r in ranks:
        assert r["rel"] < 1e-5 and r["change"] > 1e-2, r
        assert r["gas"] == 2, r  # 8 rows per step over 2 ranks of micro-batches of 2
        reward_s, reward_t = r["reward"]
        assert abs(reward_s - reward_t) < 1e-5 * max(1.0, abs(reward_s)), r
        if balance == "off":
            loss_s, loss_t = r["loss"]
            assert abs(loss_s - loss_t) < 1e-5 * max(1.0, abs(loss_s)), r
            assert r["moved"] == 0.0, r
        else:
            assert r["moved"] > 0, r  # rows did move
    if balance != "off":  # skewed windows: the plan changes the ranks' row counts (4 each before)
        rows = [r["rows"] for r in ranks]
        assert all(a + b == 8 for a, b in zip(*rows, strict=True)) and rows[0] != rows[1], rows
