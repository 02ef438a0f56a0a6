"""veRL's Ulysses sequence parallelism with forkrl's tree engine, on two gloo ranks (one Ulysses group).

The reference is stock veRL with the same ``ulysses_sequence_parallel_size``: its own input slicing,
all-to-alls and output gather, with flash-attention's CUDA kernel replaced by a CPU stand-in
(:mod:`tests.verl.ulysses_cpu`). That reference is itself checked against stock without sequence
parallelism (two data-parallel ranks on the same rows), and shown to depend on the stand-in (sdpa
alone, which sees only a rank's slice, gives another update).
"""

from __future__ import annotations

from forkrl.core.testing.ranks import run_on_ranks


def _ulysses_rank(path: str) -> dict:
    """One rank of a Ulysses group of two: per configuration its update's difference from its
    reference's (relative to stock's change), ``mixed-off``: the bf16 criterion's ``(off, near)``;
    on the group's first rank also the log-probs' and losses' differences."""
    import torch

    from forkrl.core.testing import Bf16Rounding
    from forkrl.plugins.verl import testing as h
    from tests.verl import ulysses_cpu

    h.start()  # veRL on the CPU, in run_on_ranks' gloo group
    ulysses_cpu.install()
    rollouts = h.rows(seed=0)  # every rank the same rows: one Ulysses group (dp size 1)

    def cfg(forkrl, **kw):
        return h.actor_config(forkrl, ppo_mini_batch_size=8, entropy_coeff=0.01, **kw)

    sumnorm = dict(loss_agg_mode="seq-mean-token-sum-norm")  # normalised by each micro-batch's width
    sp = dict(ulysses_sequence_parallel_size=2)
    tree = {"tree_packing": True}
    workers = {
        "dp2": (h.worker(path, cfg(None)), 16),  # no sequence parallelism: dp 2, the rows twice
        "sp2-sdpa": (h.worker(path, cfg(None, **sp)), 8),  # negative control: Ulysses without its attention
        "sp2": (h.worker(path, cfg(None, **sp)), 8),
        "tree": (h.worker(path, cfg(tree, **sp)), 8),
        "replay": (h.worker(path, cfg({"long_context_replay": True}, **sp)), 8),
        "tree-dynamic": (h.worker(path, cfg(tree, use_dynamic_bsz=True, **sp), max_token_len=40), 8),
        "sp2-dynamic": (h.worker(path, cfg(None, use_dynamic_bsz=True, **sp), max_token_len=40), 8),
        "tree-sumnorm": (h.worker(path, cfg(tree, **sumnorm, **sp)), 8),
        "sp2-sumnorm": (h.worker(path, cfg(None, **sumnorm, **sp)), 8),
        "tree-whole": (h.worker(path, cfg(tree, ppo_micro_batch_size_per_gpu=8, **sp)), 8),
        "tree-mixed": (h.worker(path, cfg(tree, precision="mixed", **sp)), 8),
        "sp2-mixed": (h.worker(path, cfg(None, precision="mixed", **sp)), 8),
    }
    for name in ("sp2", "sp2-dynamic", "sp2-sumnorm", "sp2-mixed"):
        ulysses_cpu.use_flash(workers[name][0])
    init = h.parameters(workers["sp2"][0])
    metrics = {}
    for step in range(2):
        td = h.batch(rollouts, seed=step, kl=True)
        for name, (w, mini) in workers.items():
            metrics[name] = h.update(w, td, mini, entropy=True)
    lp = {name: h.log_probs(workers[name][0], td)[0] for name in ("sp2", "tree")}
    params = {name: h.parameters(w) for name, (w, _) in workers.items()}
    change = max((params["sp2"][n] - init[n]).abs().max().item() for n in init)

    def rel(a, b):
        return max((params[a][n] - params[b][n]).abs().max().item() for n in init) / change

    values = {"dp2": rel("dp2", "sp2"), "sp2-sdpa": rel("sp2-sdpa", "sp2")}
    pairs = (
        ("tree", "sp2"),
        ("replay", "sp2"),
        ("tree-dynamic", "sp2-dynamic"),
        ("tree-sumnorm", "sp2-sumnorm"),
        ("tree-whole", "sp2"),
    )
    for name, ref in pairs:
        values[name] = rel(name, ref)

    def update(name):
        return torch.cat([(params[name][n].double() - init[n].double()).flatten() for n in sorted(init)])

    # long_context_replay under Ulysses: the group split each prompt between its ranks
    executors = workers["replay"][0].engine.forkrl.tree(1.0)._executors.values()
    values["replay-split"] = [type(e).__name__ for _, e in executors]
    bf16 = Bf16Rounding("mixed", update("tree-mixed"), update("sp2-mixed"), update("sp2"))
    values["mixed-off"] = (bf16.off, bf16.near)
    if metrics["sp2"] is not None:  # veRL collects from the Ulysses group's first rank
        values["logprobs"] = (lp["tree"] - lp["sp2"]).abs().max().item()
        for name, ref in (("tree", "sp2"), ("tree-dynamic", "sp2-dynamic")):
            a, b = metrics[ref]["loss"], metrics[name]["loss"]
            values[f"{name}-loss"] = max(abs(x - y) for x, y in zip(a, b, strict=False)) / max(
                abs(x) for x in a
            )
    else:
        assert all(metrics[n] is None for n in workers if n != "dp2") and lp["tree"] is None, metrics
    return values


def test_ulysses_group_equals_stock(tmp_path):
    """Tree packing and long-context replay (each prompt split over the group) under
    ``ulysses_sequence_parallel_size=2``: fixed and
    token-budget micro-batches, a loss normalised per micro-batch (``seq-mean-token-sum-norm``), one
    micro-batch (every rank runs it), veRL's mixed precision (the bf16 criterion): veRL's update
    after two steps, its losses and its log-probs."""
    from forkrl.core.testing.models import byte_llama, byte_tokenizer, save_pretrained

    path = save_pretrained(byte_llama(0), byte_tokenizer(), tmp_path / "model")
    ranks = run_on_ranks(_ulysses_rank, 2, str(path), init_group=False)
    for r in ranks:  # long_context_replay: each prompt split over the group (ContextParallelExecutor)
        assert r.pop("replay-split") == ["ContextParallelExecutor"], r
    values = {(rank, name): v for rank, per_name in enumerate(ranks) for name, v in per_name.items()}
    assert {k for r, k in values if r == 1} == {
        "dp2", "sp2-sdpa", "tree", "replay", "tree-dynamic", "tree-sumnorm", "tree-whole", "mixed-off"
    }  # fmt: skip
    for (rank, name), value in values.items():
        if name == "mixed-off":  # veRL's mixed precision: as accurate as stock's, and near it
            off, near = value
            assert 0.5 <= off <= 1.5 and near < 1.5, (rank, value)
        elif name == "sp2-sdpa":
            assert value > 1e-2, (rank, name, value)  # the stand-in is what makes Ulysses exact
        else:
            assert value < 1e-4, (rank, name, value)
    assert {(0, "tree-loss"), (0, "tree-dynamic-loss"), (0, "logprobs")} <= set(values), values


def _two_groups_rank(path: str) -> dict[str, float]:
    """One of four ranks (ranks 0,1 and 2,3: two Ulysses groups, two data-parallel ranks): the tree's
    update against stock's, token-mean and per-micro-batch normalised, and stock's change."""
    import torch.distributed as dist

    from forkrl.plugins.verl import testing as h
    from tests.verl import ulysses_cpu

    h.start()  # veRL on the CPU, in run_on_ranks' gloo group
    ulysses_cpu.install()
    dp = dist.get_rank() // 2
    rollouts = h.rows(seed=dp)

    def cfg(forkrl, **kw):
        return h.actor_config(forkrl, ppo_mini_batch_size=16, entropy_coeff=0.01, **kw)

    sp = dict(ulysses_sequence_parallel_size=2)
    sumnorm = dict(loss_agg_mode="seq-mean-token-sum-norm")
    workers = {
        "sp2": h.worker(path, cfg(None, **sp)),
        "tree": h.worker(path, cfg({"tree_packing": True}, **sp)),
        "sp2-sumnorm": h.worker(path, cfg(None, **sumnorm, **sp)),
        "tree-sumnorm": h.worker(path, cfg({"tree_packing": True}, **sumnorm, **sp)),
    }
    ulysses_cpu.use_flash(workers["sp2"])
    ulysses_cpu.use_flash(workers["sp2-sumnorm"])
    init = h.parameters(workers["sp2"])
    for step in range(2):
        td = h.batch(rollouts, seed=10 * dp + step, kl=True)
        for w in workers.values():
            h.update(w, td, 16, entropy=True)
    p = {n: h.parameters(w) for n, w in workers.items()}
    change = max((p["sp2"][n] - init[n]).abs().max().item() for n in init)

    def rel(a, b):
        return max((p[a][n] - p[b][n]).abs().max().item() for n in init) / change

    return {"tree": rel("tree", "sp2"), "sumnorm": rel("tree-sumnorm", "sp2-sumnorm"), "change": change}


def test_two_ulysses_groups_equal_stock(tmp_path):
    """Four ranks: two data-parallel ranks with different rows, each a Ulysses group of two (veRL's
    (dp, sp) mesh); token-mean and a per-micro-batch normalised loss."""
    from forkrl.core.testing.models import byte_llama, byte_tokenizer, save_pretrained

    path = save_pretrained(byte_llama(0), byte_tokenizer(), tmp_path / "model")
    ranks = run_on_ranks(_two_groups_rank, 4, str(path), init_group=False)
    for r in ranks:
        assert r["tree"] < 1e-4 and r["sumnorm"] < 1e-4 and r["change"] > 0, r


def _refused_rank(path: str) -> str:
    """Build a replay worker whose Ulysses group would split a sliding-window model's prompts: the
    refusal's text (raised as veRL starts the worker, before any rollout), or "" if none."""
    from forkrl.core import UnsupportedModelError
    from forkrl.plugins.verl import testing as h

    h.start()
    config = h.actor_config(
        {"long_context_replay": True}, ppo_mini_batch_size=8, ulysses_sequence_parallel_size=2
    )
    try:
        h.worker(path, config)
    except UnsupportedModelError as err:
        return str(err)
    return ""


def test_a_model_the_group_cannot_split_is_refused_when_the_worker_starts(tmp_path):
    """Sliding-window attention under long_context_replay with a Ulysses group: refused by the engine's
    initialize (the model check), naming single-device replay and veRL's own engine."""
    from forkrl.core.testing.models import byte_model, byte_tokenizer, save_pretrained

    path = save_pretrained(byte_model("mistral-swa"), byte_tokenizer(), tmp_path / "model")
    for text in run_on_ranks(_refused_rank, 2, str(path), init_group=False):
        assert "sliding" in text and "forkrl.tree_packing=false" in text, text
