"""The host-neutral step (forkrl.core.train.TreeStep) against plain autograd, in true float64.

A "host" here is two micro-batches in two different layouts (TRL-style padded with ``[B, C]``
tensors, and packed rows rolled by one), each with its own loss on its own tensors; the step must
give the gradient of the sum of those losses exactly, on every coefficient path.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from forkrl.core import RowLayout, TreeOptions, TreeStep
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.models import dense_logprobs, grads, left_padded, max_rel_err
from forkrl.core.testing.models import tiny_causal_lm as make_model
from forkrl.core.train import HostDefaults, StepInputs, StepLoss

TOL = 1e-10


def _micro_batches(vocab=61, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    system = rand(6)
    prompts = [system + rand(3), system + rand(2)]
    rows = [(prompts[i % 2], rand(1 + (3 * i) % 5)) for i in range(6)]
    rows[3] = (rows[1][0], rows[1][1] + rand(2))  # a completion extending another one
    return rows[:3], rows[3:]


def _padded(rows):
    P = max(len(p) for p, _ in rows)
    C = max(len(c) for _, c in rows)
    ids, mask = left_padded(rows)
    return RowLayout.padded(ids, mask, C), mask[:, P:].bool()


def _packed(rows):
    seqs = [p + c for p, c in rows]
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    layout = RowLayout.packed(
        torch.tensor([t for s in seqs for t in s]), cu, [len(p) for p, _ in rows], align="next"
    )
    return layout, layout.mask()


def _losses(kind: str, masks, adv, old):
    """One host loss per micro-batch, on its own layout's tensors."""

    def loss_fn(i, lp, ent):
        m = masks[i].to(lp.dtype)
        if kind == "linear":  # value-independent gradient: on-policy policy gradient + entropy bonus
            return -(adv[i] * lp * m).sum() / m.sum() - 0.01 * (ent * m).sum() / m.sum()
        ratio = torch.exp(lp - old[i])
        clipped = torch.minimum(ratio * adv[i], ratio.clamp(0.8, 1.2) * adv[i])
        return (
            -(clipped * m).sum() / m.sum() + 0.05 * ((torch.exp(old[i] - lp) - (old[i] - lp) - 1) * m).sum()
        )

    return loss_fn


def _dense_grad(model, rows_per_mb, loss_fn, layouts):
    model.zero_grad(set_to_none=True)
    total = 0
    for i, (rows, layout) in enumerate(zip(rows_per_mb, layouts, strict=True)):
        seqs = [p + c for p, c in rows]
        lps, ents = dense_logprobs(model, seqs, [len(p) for p, _ in rows], entropy=True)
        total = total + loss_fn(i, layout.to_host(torch.cat(lps)), layout.to_host(torch.cat(ents)))
    total.backward()
    return grads(model), total.detach()


@pytest.mark.parametrize(
    "kind,path,expect",
    [
        ("linear", "constant", "constant"),
        ("linear", "general", "general"),
        ("ppo", "general", "general"),
        ("ppo", "token_local", "token_local"),
        ("ppo", "constant", "general"),  # negative control: a wrong claim is caught by the probe
    ],
)
@pytest.mark.parametrize("mode", ["auto", "replay"])
def test_step_equals_plain_autograd_over_two_layouts(kind, path, expect, mode):
    model = make_model("llama-gqa")
    rows_per_mb = _micro_batches()
    (lay_a, mask_a), (lay_b, mask_b) = _padded(rows_per_mb[0]), _packed(rows_per_mb[1])
    g = torch.Generator().manual_seed(5)
    per_row = torch.randn(3, generator=g, dtype=torch.float64)
    adv = [
        torch.randn(3, 1, generator=g, dtype=torch.float64),  # [B, 1] against [B, C] tensors
        lay_b.to_host(torch.repeat_interleave(per_row, torch.tensor(lay_b.scored))),  # per packed token
    ]
    old = [torch.randn(lay.shape, generator=g, dtype=torch.float64) * 0.1 - 3 for lay in (lay_a, lay_b)]
    loss_fn = _losses(kind, [mask_a, mask_b], adv, old)
    with Float64Mode():
        want, want_loss = _dense_grad(model, rows_per_mb, loss_fn, [lay_a, lay_b])
        model.zero_grad(set_to_none=True)
        opts = TreeOptions(tree_packing=True, tree_mode=mode, tree_block_size=3 if mode == "replay" else None)
        step = TreeStep(opts)
        res = step.train(model, [lay_a, lay_b], StepLoss(loss_fn, path, quiet=contextlib.nullcontext))
    assert res.objective.path == expect
    assert step.fused_ok == (expect == "constant" or path != "constant")
    assert max_rel_err(grads(model), want) < TOL
    assert abs(float(res.loss) - float(want_loss)) < 1e-12
    m = res.metrics.as_dict()
    assert m["tree/compression"] > 1.0 and m["tree/mode"] == (1.0 if mode == "replay" else 0.0)
    assert m["tree/dense_tokens"] == sum(len(p) + len(c) for mb in rows_per_mb for p, c in mb)


def test_mode_choice_and_executor_cache():
    model = make_model("llama-gqa", dtype=torch.float32)
    step = TreeStep(TreeOptions(tree_packing=True, tree_replay_threshold=10))
    assert step.options.mode_for(8) == "keep" and step.options.mode_for(11) == "replay"
    assert step.options.mode_for(8, gradient_checkpointing=True) == "replay"
    assert TreeOptions(long_context_replay=True).mode_for(1) == "replay"
    assert step.executor(model, "keep") is step.executor(model, "keep")
    replay = step.executor(model, "replay")
    assert replay.mode == "replay" and replay.block_size == 2048


def test_a_nan_advantage_stops_the_step_before_anything_is_accumulated():
    model = make_model("llama-gqa")
    rows_per_mb = _micro_batches()
    lay_a, mask_a = _padded(rows_per_mb[0])

    def loss_fn(i, lp, ent):
        adv = torch.tensor([[1.0], [float("nan")], [0.5]], dtype=lp.dtype)
        return -(adv * lp * mask_a).sum()

    for path in ("constant", "general", "token_local"):
        with Float64Mode(), pytest.raises(ValueError, match="nothing was accumulated"):
            TreeStep(TreeOptions(tree_packing=True)).train(model, [lay_a], StepLoss(loss_fn, path))
        assert all(p.grad is None for p in model.parameters())


def test_share_micro_batches_divides_a_group_contiguously_by_tokens():
    """Every micro-batch on exactly one rank, in contiguous non-empty runs near equal in tokens;
    fewer micro-batches than ranks: None (every rank runs all)."""
    from forkrl.core.train import share_micro_batches

    g = torch.Generator().manual_seed(0)
    for size in (2, 3, 4):
        for count in range(size, 12):
            tokens = torch.randint(1, 100, (count,), generator=g).tolist()
            runs = [share_micro_batches(tokens, size, r) for r in range(size)]
            assert [i for run in runs for i in run] == list(range(count)), (tokens, runs)
            assert all(run and run == list(range(run[0], run[-1] + 1)) for run in runs)
            loads = [sum(tokens[i] for i in run) for run in runs]
            # a cut moves at most one micro-batch past the ideal share
            assert max(loads) <= sum(tokens) / size + max(tokens), (tokens, runs)
    assert share_micro_batches([5, 5, 5, 5], 2, 0) == [0, 1] and share_micro_batches([5, 5, 5, 5], 2, 1) == [
        2,
        3,
    ]
    assert share_micro_batches([90, 5, 5], 2, 0) == [0] and share_micro_batches([90, 5, 5], 2, 1) == [1, 2]
    assert share_micro_batches([4], 2, 0) is None and share_micro_batches([4, 4], 1, 0) is None


class _ToyHost(HostDefaults):
    """A host for :class:`TreeRunner` whose micro-batches are lists of ``(prompt, completion)`` rows
    (padded layouts), its loss ``_losses``' clipped PPO; with ``engine`` it backs the replica's
    gradient into the model as an engine's backward would. The rest is :class:`HostDefaults`'."""

    def __init__(self, loss_fn):
        self.loss_fn, self.logged, self.handed = loss_fn, [], 0

    def inputs(self, window):
        rows = sum(len(mb) for mb in window)
        return StepInputs([_padded(mb)[0] for mb in window], images=[[] for _ in range(rows)])

    def loss(self, window, router):
        assert router is None
        return StepLoss(self.loss_fn, "general")

    def hand_over(self, replica):
        replica.gradient_surrogate().backward()
        self.handed += 1

    def log(self, metrics):
        self.logged.append(metrics)


@pytest.mark.parametrize("engine", [False, True])
def test_runner_step_equals_plain_autograd_and_logs_the_step(engine):
    """:meth:`TreeRunner.step` with a host's micro-batches: the gradient of the host's loss (through
    an engine's hand-over with ``engine``), a text window's empty image lists dropped, one metrics
    dict to the host's sink."""
    from forkrl.core.train import TreeRunner

    model = make_model("llama-gqa")
    rows_per_mb = [list(mb) for mb in _micro_batches(seed=3)]
    layouts, masks = zip(*(_padded(mb) for mb in rows_per_mb), strict=True)
    g = torch.Generator().manual_seed(2)
    adv = [torch.randn(3, 1, generator=g, dtype=torch.float64) for _ in layouts]
    old = [torch.randn(lay.shape, generator=g, dtype=torch.float64) * 0.1 - 3 for lay in layouts]
    loss_fn = _losses("ppo", list(masks), adv, old)
    host = _ToyHost(loss_fn)
    with Float64Mode():
        want, want_loss = _dense_grad(model, rows_per_mb, loss_fn, list(layouts))
        model.zero_grad(set_to_none=True)
        runner = TreeRunner(TreeOptions(tree_packing=True), host, engine=engine)
        run = runner.step(model, rows_per_mb)
    assert max_rel_err(grads(model), want) < TOL
    assert abs(float(run.loss) - float(want_loss)) < 1e-12
    assert host.handed == int(engine) and len(host.logged) == 1
    assert host.logged[0] == run.metrics and run.metrics["tree/compression"] > 1.0
    assert run.window == rows_per_mb
