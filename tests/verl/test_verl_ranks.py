"""Two gloo ranks under veRL's FSDP2 engine: ranks hold different forests (rank 0 groups that share
prompts, rank 1 rows that share nothing) and the tree engine's update still equals veRL's own,
with the mini-batch's rows moved between the ranks by tree cost (``tree_balance: auto``) and without."""

from __future__ import annotations

import pytest

from forkrl.core.testing.ranks import run_on_ranks


def _two_rank_updates(path: str, balances: list[str], shape: str) -> dict[str, dict]:
    """One rank of stock veRL and forkrl's engine (one per ``tree_balance`` setting) on two steps of
    this rank's rows (``shape``: ``skewed``, ``uneven``, ``uneven-dynamic``); per setting: the
    update's difference from stock's (relative to stock's change), both losses, the rows the
    balancer moved (-1: not logged) and this rank's row count after each rebalancing."""
    import torch
    import torch.distributed as dist

    import forkrl.plugins.verl.engine as engine
    from forkrl.plugins.verl import testing as h

    h.start()  # veRL on the CPU, in run_on_ranks' gloo group
    rows_after = []
    balance_mini_batch = engine.balance_mini_batch

    def spy(*args, **kwargs):  # this rank's row count after each rebalancing
        out, result = balance_mini_batch(*args, **kwargs)
        rows_after.append(len(out))
        return out, result

    engine.balance_mini_batch = spy
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return torch.randint(0, 250, (n,), generator=g).tolist()

    dynamic = shape.endswith("-dynamic")  # veRL's token-budget micro-batches
    kw = dict(use_dynamic_bsz=True) if dynamic else {}
    tokens = 48 if dynamic else None
    if shape.startswith(
        "uneven"
    ):  # rank 0 one cheap group of 8, rank 1 eight costly rows: counts should change
        if rank == 0:
            prompt = rand(12)
            rollouts = [(prompt, rand(2 + k % 3)) for k in range(8)]
        else:
            rollouts = [([k] + rand(30), rand(3)) for k in range(8)]
    elif rank == 0:  # two GRPO groups (two trees: the second's opening differs)
        rollouts = [(p if i < 4 else [251] + p[1:], r) for i, (p, r) in enumerate(h.rows(seed=0))]
    else:  # nothing shared between rows, and longer: the costlier rank, until rows move
        rollouts = [([k] + rand(11 + k % 3), rand(2 + k % 4)) for k in range(8)]
    stock = h.worker(path, h.actor_config(None, ppo_mini_batch_size=16, **kw), max_token_len=tokens)
    trees = {
        b: h.worker(
            path,
            h.actor_config({"tree_packing": True, "tree_balance": b}, ppo_mini_batch_size=16, **kw),
            max_token_len=tokens,
        )
        for b in balances
    }
    init = h.parameters(stock)
    rows_of, mts = {}, {}
    for step in range(2):
        td = h.batch(rollouts, seed=10 * rank + step, kl=True)
        ms = h.update(stock, td, 16, entropy=True)
        for b, tree in trees.items():
            rows_after.clear()
            mts[b] = h.update(tree, td, 16, entropy=True)
            rows_of[b] = list(rows_after)
    p_stock = h.parameters(stock)
    change = max((p_stock[n] - init[n]).abs().max().item() for n in p_stock)
    results = {}
    for b, tree in trees.items():
        p_tree, mt = h.parameters(tree), mts[b]
        rel = max((p_tree[n] - p_stock[n]).abs().max().item() for n in p_stock) / change
        if b != "off":  # the slowest rank's measured step beside the plan's prediction
            assert (
                mt["tree/balance_measured_imbalance"][0] >= 1.0
                and mt["tree/balance_predicted_makespan"][0] > 0
            )
        moved = mt.get("tree/balance_moved_rows", [-1])
        moved = moved[0] if isinstance(moved, list) else moved
        results[b] = {
            "rel": rel,
            "change": change,
            "loss": (ms["loss"][0], mt["loss"][0]),
            "moved": float(moved),
            "rows": rows_of[b],
        }
    return results


@pytest.mark.parametrize(
    "balances,shape", [("auto,off", "skewed"), ("on", "uneven"), ("on", "uneven-dynamic")]
)
def test_two_ranks_equal_stock(tmp_path, balances, shape):
    """Stock's update with and without the balancer (one run trains stock and each setting); in
    ``uneven`` the plan changes the ranks' row counts, and each rank still trains 4 micro-batches
    (of unequal sizes); ``-dynamic``: veRL's token-budget micro-batches (the same count on every
    rank, as veRL makes them)."""
    from forkrl.core.testing.models import byte_llama, byte_tokenizer, save_pretrained

    path = save_pretrained(byte_llama(0), byte_tokenizer(), tmp_path / "model")
    ranks = run_on_ranks(_two_rank_updates, 2, str(path), balances.split(","), shape, init_group=False)
    counts: dict[str, list[list[int]]] = {}
    for per_balance in ranks:
        assert set(per_balance) == set(balances.split(",")), per_balance
        for balance, r in per_balance.items():
            assert r["rel"] < 1e-4 and r["change"] > 0, r
            loss_s, loss_t = r["loss"]
            assert abs(loss_s - loss_t) < 1e-4 * max(1.0, abs(loss_s)), r
            assert r["moved"] > 0 if balance != "off" else r["moved"] == -1, r  # rows moved; off left them
            counts.setdefault(balance, []).append(r["rows"])
    if shape.startswith("uneven"):
        first = [c[0] for c in counts["on"]]
        assert sum(first) == 16 and first[0] != first[1], counts
    else:
        assert counts["off"] == [[], []], counts


def _video_refusal(model_path: str) -> dict:
    """One rank's update of a batch in which one row of rank 0 carries video: the error this rank
    raised (the message up to its first colon), whether the parameters and gradients were left
    untouched, and how far the next (clean) batch then moved the parameters."""
    import torch
    import torch.distributed as dist

    from forkrl.plugins.verl import testing as h

    h.start()  # veRL on the CPU, in run_on_ranks' gloo group
    rank = dist.get_rank()
    tree = h.worker(model_path, h.actor_config({"tree_packing": True}, ppo_mini_batch_size=16))
    rollouts = h.rows(seed=rank)
    clean = h.agent_loop_fields(h.batch(rollouts, seed=rank), rollouts)
    td = clean.clone()
    if rank == 0:  # one row of one rank carries video
        from verl.utils import tensordict_utils as tu

        rows = [{} for _ in rollouts]
        rows[3] = {"pixel_values_videos": torch.zeros(16, 1176), "video_grid_thw": torch.tensor([[1, 4, 4]])}
        tu.assign_non_tensor_stack(td, "multi_modal_inputs", rows)
    before = h.parameters(tree)
    try:
        h.update(tree, td, 16, True)
        error = None
    except ValueError as err:
        error = str(err).split(":")[0]
    after = h.parameters(tree)
    unchanged = all(torch.equal(after[n], before[n]) for n in before)
    no_grad = all(p.grad is None or not p.grad.any() for p in tree.engine.module.parameters())
    h.update(tree, clean, 16, True)  # the ranks are still in step: the next batch trains on both
    moved = max((h.parameters(tree)[n] - before[n]).abs().max().item() for n in before)
    return {"error": error, "untouched": unchanged and no_grad, "moved": moved}


def test_a_refusal_on_one_rank_stops_every_rank(tmp_path):
    """Video in one rank's rows (a vision-language model, two gloo ranks): that rank refuses it and
    the other learns of it and raises too, before the step's first collective, nothing changed on
    either (without the agreement the other rank waits in veRL's token all-reduce for ever); both
    then train the next batch. Bounded by the run's timeout."""
    from forkrl.core.testing.vision import qwen_vl_model, qwen_vl_processor

    processor = qwen_vl_processor()
    model = qwen_vl_model(processor.tokenizer, tie_word_embeddings=False)
    model.save_pretrained(tmp_path / "model")
    processor.tokenizer.save_pretrained(tmp_path / "model")
    ranks = run_on_ranks(_video_refusal, 2, str(tmp_path / "model"), init_group=False, timeout=300)
    assert [r["error"] for r in ranks] == [
        "row 3 carries video (pixel_values_videos, video_grid_thw)",
        "another rank refused this batch before the step (see that rank's error",
    ], ranks
    for r in ranks:
        assert r["untouched"] and r["moved"] > 0, r
