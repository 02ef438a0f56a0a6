"""The tree-aware balancer: plans are partitions that respect row counts, keep trees whole unless a
tree exceeds a rank's share, come close to the lower bound on GRPO-shaped steps, and do not change
the step's gradient (global token-mean normalisation, float64); the cost model's fit."""

from __future__ import annotations

import random

import pytest
import torch

from forkrl.core import PrefixForest, RowLayout, TreeOptions, TreeStep
from forkrl.core.balance import (
    CostModel,
    OnlineCostModel,
    PieceStats,
    balance,
    evaluate,
    forest_stats,
    trees_of_forest,
)
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.models import grads, max_rel_err, tiny_causal_lm


def _grpo(groups: int, g: int, seed: int = 0, vocab: int = 60):
    rng = random.Random(seed)
    seqs, score_from = [], []
    for q in range(groups):
        prompt = [q % vocab] + [rng.randrange(vocab) for _ in range(rng.choice([4, 8, 40]))]
        for _ in range(g):
            seqs.append(prompt + [rng.randrange(vocab) for _ in range(1 + int(rng.expovariate(1 / 6)))])
            score_from.append(len(prompt))
    return seqs, score_from


def test_trees_of_forest_describe_the_forest():
    seqs, sf = _grpo(5, 4)
    forest = PrefixForest.build(seqs, sf)
    trees = trees_of_forest(forest)
    assert sorted(s for t in trees for s in t.ids) == list(range(len(seqs)))
    assert sum(t.stats().tokens for t in trees) == forest.unique_tokens
    assert sum(t.stats().units for t in trees) == len(forest.nodes)
    one = trees[0]
    assert one.stats([0]).tokens == len(seqs[one.ids[0]])  # a single path is its sequence


@pytest.mark.parametrize("rows_per_rank", [None, 8])
def test_plan_is_a_partition_with_equal_rows(rows_per_rank):
    seqs, sf = _grpo(12, 4, seed=1)
    trees = trees_of_forest(PrefixForest.build(seqs, sf))
    plan = balance(trees, 6, rows_per_rank=rows_per_rank)
    assert sorted(s for r in plan.ranks for s in r) == list(range(len(seqs)))
    if rows_per_rank:
        assert all(len(r) == rows_per_rank for r in plan.ranks)
    assert plan.makespan >= plan.lower_bound * (1 - 1e-12)
    assert plan.seconds >= 0


def test_grpo_step_is_near_the_bound_and_beats_length_balancing():
    seqs, sf = _grpo(64, 8, seed=2)
    trees = trees_of_forest(PrefixForest.build(seqs, sf))
    model = CostModel(per_token=1.0, per_attended=0.01, per_unit=5.0)
    plan = balance(trees, 8, model, rows_per_rank=64)
    assert plan.split_trees == 0 and plan.makespan_ratio < 1.05
    # Rows dealt by length, longest first to the shortest rank (what length balancing does).
    order = sorted(range(len(seqs)), key=lambda s: -len(seqs[s]))
    ranks, loads = [[] for _ in range(8)], [0] * 8
    for s in order:
        r = min((q for q in range(8) if len(ranks[q]) < 64), key=lambda q: loads[q])
        ranks[r].append(s)
        loads[r] += len(seqs[s])
    assert evaluate(trees, ranks, model).makespan > 1.5 * plan.makespan


def test_without_equal_rows_the_plan_is_near_the_bound():
    """Free row counts (veRL), one costly group among 64: the plan comes within 3% of the bound, no
    worse than with equal rows (pieces move as well as swap, and are cut finer when a whole-group
    plan stays above the bound)."""
    seqs, sf = _grpo(64, 8, seed=3)
    big = [0] + list(range(200, 200 + 250))  # one prompt of 251 tokens, 8 responses
    seqs += [big + [1 + k] for k in range(8)]
    sf += [len(big)] * 8
    trees = trees_of_forest(PrefixForest.build(seqs, sf))
    model = CostModel(per_token=1.0, per_attended=0.01, per_unit=5.0)
    free = balance(trees, 8, model)
    equal = balance(trees, 8, model, rows_per_rank=len(seqs) // 8)
    assert sorted(s for r in free.ranks for s in r) == list(range(len(seqs)))
    assert free.makespan_ratio < 1.03 and free.makespan <= equal.makespan
    assert len({len(r) for r in free.ranks}) > 1  # row counts differ


def test_a_tree_larger_than_a_share_is_split_and_each_part_pays_its_prefix():
    seqs, sf = _grpo(1, 16, seed=3)
    seqs += [[59, 1, 2, 3]] * 2
    sf += [2, 2]
    trees = trees_of_forest(PrefixForest.build(seqs, sf))
    plan = balance(trees, 4)
    assert plan.split_trees == 1
    big = max(trees, key=lambda t: len(t.ids))
    prefix = big.stats([0]).tokens - (len(seqs[big.ids[0]]) - sf[big.ids[0]])
    assert sum(plan.costs) >= big.stats().tokens + 3 * prefix - 1e-9  # four ranks hold the prompt


def test_cost_model_fit_recovers_coefficients():
    rng = random.Random(0)
    shapes = [
        PieceStats(rng.uniform(1e2, 1e4), rng.uniform(1e4, 1e7), rng.randrange(1, 40), rng.uniform(10, 2e3))
        for _ in range(30)
    ]
    truth = CostModel(per_token=2e-5, per_attended=3e-9, per_unit=1e-3, per_scored=4e-4)
    exact = CostModel.fit(shapes, [truth.predict(s) for s in shapes])
    for name in ("per_token", "per_attended", "per_unit", "per_scored"):
        assert getattr(exact, name) == pytest.approx(getattr(truth, name), rel=1e-9)
    noisy = CostModel.fit(shapes, [truth.predict(s) * rng.uniform(0.95, 1.05) for s in shapes])
    errors = [abs(noisy.predict(s) - truth.predict(s)) / truth.predict(s) for s in shapes]
    assert max(errors) < 0.1
    # A feature that does not explain the timings gets 0, never a negative cost.
    flat = CostModel.fit(shapes, [1e-5 * s.tokens for s in shapes])
    assert (
        flat.per_attended >= 0
        and flat.per_unit >= 0
        and flat.per_scored >= 0
        and flat.per_token == pytest.approx(1e-5, rel=1e-6)
    )
    with pytest.raises(ValueError, match="at least 4"):
        CostModel.fit(shapes[:3], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="finite"):
        CostModel.fit(shapes[:4], [1.0, float("nan"), 2.0, 3.0])
    with pytest.raises(ValueError, match="per_unit"):
        CostModel(per_unit=-1.0)


def test_balancing_does_not_change_the_step_gradient():
    """Two simulated ranks, token-mean over the whole step (global normaliser): the summed gradient
    of the balanced assignment equals the original one's in float64."""
    seqs, sf = _grpo(4, 3, seed=4)
    trees = trees_of_forest(PrefixForest.build(seqs, sf))
    plan = balance(trees, 2, rows_per_rank=6)
    original = [list(range(0, 12, 2)), list(range(1, 12, 2))]  # groups scattered, as length balancing does
    assert sorted(map(sorted, plan.ranks)) != sorted(map(sorted, original))
    total = sum(len(s) - f for s, f in zip(seqs, sf, strict=True))

    def step_grad(assignment) -> list[torch.Tensor]:
        with Float64Mode():
            model = tiny_causal_lm("llama-gqa")
            model.train()
            step = TreeStep(TreeOptions(tree_packing=True))
            for rows in assignment:
                layout = RowLayout.spans([torch.tensor(seqs[s]) for s in rows], [sf[s] for s in rows])

                def loss_fn(i, lp, ent, layout=layout):
                    return -(lp * layout.mask(lp.device)).sum() / total  # the step's token count

                step.train(model, [layout], loss_fn)
            return grads(model)

    assert max_rel_err(step_grad(plan.ranks), step_grad(original)) < 1e-12


def test_bounds_hold_against_the_brute_force_optimum():
    """Every assignment of 8 rows (4 groups of 2) to 2 ranks of 4 rows: the optimum is at least both
    lower bounds, and the balancer's plan is at least the optimum (costs are the same model's)."""
    import itertools

    from forkrl.core.balance import rows_bound

    seqs, sf = _grpo(4, 2, seed=5)
    trees = trees_of_forest(PrefixForest.build(seqs, sf))
    model = CostModel(per_token=1.0, per_attended=0.01, per_unit=3.0)
    best = min(
        evaluate(trees, [list(half), [s for s in range(8) if s not in half]], model).makespan
        for half in itertools.combinations(range(8), 4)
    )
    plan = balance(trees, 2, model, rows_per_rank=4)
    assert plan.lower_bound <= best + 1e-9 and rows_bound(trees, model, 4) <= best + 1e-9
    assert plan.makespan >= best - 1e-9
    assert plan.makespan <= 1.25 * best


def test_online_cost_model_fits_the_steps_seen():
    """Before min_samples: the default model; then the least-squares fit of the newest samples (a known
    linear model is recovered); forest_stats is the forest's own token count."""
    truth = CostModel(per_token=2e-4, per_attended=3e-8, per_unit=1e-3, per_scored=5e-5)
    online = OnlineCostModel(min_samples=6, max_samples=10)
    assert online.model is online.default and not online.fitted
    rng = random.Random(0)
    for i in range(12):
        stats = PieceStats(
            rng.uniform(1e3, 9e3), rng.uniform(1e5, 9e6), rng.randint(2, 40), rng.uniform(1e2, 4e3)
        )
        online.observe(stats, truth.predict(stats))
        assert online.fitted == (i + 1 >= 6)
    assert len(online.samples) == 10  # the newest max_samples
    for name in ("per_token", "per_attended", "per_unit", "per_scored"):
        assert getattr(online.model, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    idle = OnlineCostModel(min_samples=4)
    for _ in range(5):
        idle.observe(PieceStats(10, 10, 1, 1), 0.0)  # no signal: stays on the default
    assert not idle.fitted
    with pytest.raises(ValueError, match="min_samples"):
        OnlineCostModel(min_samples=2)
    forest = PrefixForest.build(*_grpo(3, 4))
    assert forest_stats(forest).tokens == forest.unique_tokens


def test_rebalanced_metrics_report_predicted_and_measured_makespans():
    from forkrl.core.balance import Rebalanced

    r = Rebalanced(
        rows=[], moved=3, predicted_before=12.0, predicted_after=8.0, lower_bound=7.5, seconds=0.01
    )
    m = r.metrics(measured=[2.0, 1.0])
    assert m["tree/balance_predicted_gain"] == 1.5 and m["tree/balance_predicted_makespan"] == 8.0
    assert (
        m["tree/balance_measured_makespan"] == 2.0
        and abs(m["tree/balance_measured_imbalance"] - 2.0 / 1.5) < 1e-12
    )
    assert "tree/balance_measured_makespan" not in r.metrics()  # nothing measured yet
    model = OnlineCostModel(min_samples=4)
    assert model.observe(PieceStats(10.0, 50.0, 2.0, 8.0), 0.5) == [0.5]  # one process: its own time


def _rank_plans() -> list[dict]:
    """One rank's share of the plan, for equal_rows True and False: the rows it trains and the
    plan's figures as this rank saw them."""
    import torch.distributed as dist

    from forkrl.core.balance import rebalance

    rank = dist.get_rank()
    seqs, score_from = _grpo(4, 4, seed=3)
    mine = [(i, s, f) for i, (s, f) in enumerate(zip(seqs, score_from, strict=True)) if i % 2 == rank]
    # Each rank's own fit of the same samples: equal up to rounding in a real run (MKL's least
    # squares differs in the last bits between processes); here made different enough to change
    # the plan.
    if rank == 0:
        model = CostModel(per_token=1.0)
    else:
        model = CostModel(per_token=0.0, per_unit=1.0, per_scored=3.0)
    plans = []
    for equal_rows in (True, False):
        result = rebalance(mine, lambda r: (r[1], r[2]), model, equal_rows=equal_rows)
        plans.append(
            {
                "equal_rows": equal_rows,
                "ids": [r[0] for r in result.rows],
                "figures": (result.predicted_after, result.moved),
            }
        )
    return plans


@pytest.mark.slow
def test_ranks_follow_one_plan_whatever_their_cost_models():
    """Every rank trains exactly its share of one plan, made once: ranks whose online cost models
    differ (a fit on each rank; rounding differs between processes) must not each plan for
    themselves, or a row is trained twice and another never (a silently wrong update)."""
    from forkrl.core.testing.ranks import run_on_ranks

    ranks = run_on_ranks(_rank_plans, 2)
    for equal_rows in (True, False):
        parts = [plan for plans in ranks for plan in plans if plan["equal_rows"] == equal_rows]
        assert len(parts) == 2, ranks
        ids = sorted(i for plan in parts for i in plan["ids"])
        assert ids == list(range(16)), (equal_rows, parts)  # every row once
        assert parts[0]["figures"] == parts[1]["figures"], parts  # the same figures on every rank


def test_balance_option_decides_and_refuses_as_each_host_spells_it():
    """``tree_balance``'s rule (:mod:`forkrl.core.balance.rules`): auto and on balance over several
    ranks unless the rows cannot move or the loss reads a micro-batch; on is refused there and with
    one rank, in the host's words; off never balances and is never refused."""
    from forkrl.core.balance.rules import IMAGES, ROUTER_LOSS, BalanceOption, shared_by

    option = BalanceOption(on="tb=on", auto="tb=auto", off="tb=off", update="Host's update")
    group = shared_by("a ring group", "mini-batch")
    for choice in ("auto", "on"):
        assert option.balances(choice, 2)
        assert not option.balances(choice, 1)
        assert not option.balances(choice, 4, fixed=IMAGES)
        assert not option.balances(choice, 4, loss=ROUTER_LOSS)
    assert not option.balances("off", 4)
    for choice in ("auto", "off"):
        assert option.refusal(choice, 1, fixed=group, loss=ROUTER_LOSS) is None
    assert option.refusal("on", 2) is None and option.refusal("on") is None
    assert option.refusal("on", 1, counted="2 GPUs / 2") == (
        "tb=on balances rows over data-parallel ranks, and this run has one (2 GPUs / 2), so it would have no "
        "effect: drop it (the default auto balances when there are several)"
    )
    # rows that cannot move are named first, then one rank, then the loss
    assert option.refusal("on", 1, fixed=group, loss=ROUTER_LOSS) == (
        "tb=on moves rows between data-parallel ranks, which a ring group does not do: its ranks share each "
        "mini-batch's micro-batches instead; use tb=auto (which leaves the rows in place) or tb=off"
    )
    assert "without their images" in option.refusal("on", fixed=IMAGES)
    assert option.refusal("on", 2, loss=ROUTER_LOSS) == (
        f"tb=on would change Host's update: {ROUTER_LOSS}; use tb=off (or tb=auto, which leaves the rows in "
        "place for such a loss)"
    )


def test_moved_rows_are_padded_again_as_the_hosts_lay_them_out():
    """:func:`padded` and :func:`prompt_response`: rows without their padding collated into the
    hosts' layouts (right- or left-padded fields; ``[left-padded prompt | right-padded response]``)."""
    from forkrl.core.balance import padded, prompt_response

    rows = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    assert padded(rows, 4).tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    assert padded(rows, 3, left=True, fill=9).tolist() == [[1, 2, 3], [9, 9, 4]]
    wide = [torch.ones(2, 2), torch.ones(1, 2)]
    assert padded(wide, 2).shape == (2, 2, 2) and padded(wide, 2)[1, 1].tolist() == [0.0, 0.0]
    # prompts [1, 2] and [4]; responses [3] and [5, 6]: two prompt columns, four in all
    joined = prompt_response([torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])], [2, 1], 2, 4)
    assert joined.tolist() == [[1, 2, 3, 0], [0, 4, 5, 6]]
