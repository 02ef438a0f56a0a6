"""The level-batched pass (``core/executor/levels.py``): the units at one depth of many trees as
one forward, exact against the plain computation and the depth-first pass, with bounded memory."""

from __future__ import annotations

import pytest
import torch

from forkrl.core import PrefixForest, TreeExecutor, compat
from forkrl.core.attention import level
from forkrl.core.executor import levels
from forkrl.core.testing import Float64Mode, SavedBytes
from forkrl.core.testing.forests import deep_tree, grpo_group
from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err
from forkrl.core.testing.models import tiny_causal_lm as make_model

TOL = 1e-10


def _steps(groups: int = 5) -> tuple[list[list[int]], list[int]]:
    """Several GRPO groups with prompts of different lengths, a multi-turn tree, a lone sequence."""
    seqs, score_from = [], []
    for g in range(groups):
        s, f = grpo_group(seed=10 + g, prompt=4 + 3 * g, group=3 + g % 3)
        seqs += s
        score_from += f
    s, f = deep_tree(seed=7)
    seqs, score_from = seqs + s, score_from + f
    return [*seqs, [5, 9, 3, 2]], [*score_from, 2]


def _coefs(seqs, score_from, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [
        [
            torch.randn(len(s) - f, generator=g, dtype=torch.float64)
            for s, f in zip(seqs, score_from, strict=True)
        ]
        for _ in range(2)
    ]


def _counting(monkeypatch) -> list[int]:
    """Bundles of every level pass built from now on (none: the depth-first pass ran)."""
    built: list[int] = []
    init = levels.LevelPass.__init__

    def counted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(len(self.bundles))

    monkeypatch.setattr(levels.LevelPass, "__init__", counted)
    return built


@pytest.mark.parametrize(
    "name,budget,collapse",
    [(n, b, 64) for n in ("llama-gqa", "llama-mqa", "qwen3") for b in (1, 40, 1 << 20)]
    + [("llama-gqa", b, c) for b in (1, 40, 1 << 20) for c in (0, 4)],
)
def test_many_trees_are_exact(monkeypatch, name, budget, collapse):
    """Gradients, log-probs and entropies of a level pass equal the plain computation's (float64),
    whether every tree is its own bundle and every leaf its own batch (budget 1), or a few trees
    share a bundle, or all share one; with short internal nodes copied into their children or kept
    (every depth its own run, ancestors at several depths); and equal the depth-first pass's."""
    model = make_model(name)
    seqs, score_from = _steps()
    forest = PrefixForest.build(seqs, score_from)
    c_lp, c_ent = _coefs(seqs, score_from)
    built = _counting(monkeypatch)
    with Float64Mode():
        model.zero_grad(set_to_none=True)
        lps, ents = dense_logprobs(model, seqs, score_from, 0.8, entropy=True)
        sum(
            (a * c).sum() + (e * d).sum() for a, e, c, d in zip(lps, ents, c_lp, c_ent, strict=True)
        ).backward()
        want = grads(model)
        ex = TreeExecutor(
            model,
            temperature=0.8,
            leaf_batch_tokens=budget,
            score_batch_tokens=budget,
            collapse_tokens=collapse,
        )
        scored = ex.score(forest, entropy=True)
        model.zero_grad(set_to_none=True)
        res = ex.backward(forest, c_lp, c_ent)
        got = grads(model)
        model.zero_grad(set_to_none=True)
        TreeExecutor(model, temperature=0.8, level_batching=False).backward(forest, c_lp, c_ent)
        depth_first = grads(model)
    trees = sum(1 for n in forest.nodes if n.parent < 0)
    assert built and built[-1] == {1: trees, 1 << 20: 1}.get(budget, built[-1]) and 1 <= built[-1] <= trees
    assert max_rel_err(scored.logprobs, [t.detach() for t in lps]) < TOL
    assert max_rel_err(scored.entropies, [t.detach() for t in ents]) < TOL
    assert max_rel_err(res.logprobs, [t.detach() for t in lps]) < TOL
    assert max_rel_err(got, want) < TOL
    assert max_rel_err(got, depth_first) < 1e-12


def test_a_step_runs_the_decoder_once_per_depth():
    """Eight GRPO groups run the decoder twice (all prompts, then all completions); depth first
    runs it twice per group."""
    model = make_model("llama-gqa", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    seqs, score_from = [], []
    for group in range(8):
        prompt = torch.randint(0, 61, (6 + group,), generator=g).tolist()
        # completions that part at their first token: a two-level tree per group
        seqs += [[*prompt, i, *torch.randint(0, 61, (2 + i,), generator=g).tolist()] for i in range(4)]
        score_from += [len(prompt)] * 4
    forest = PrefixForest.build(seqs, score_from)
    coefs = [torch.ones(len(s) - f) for s, f in zip(seqs, score_from, strict=True)]
    runs = {}
    for batching in (True, False):
        ex = TreeExecutor(model, level_batching=batching).verify()
        calls = [0]
        hook = model.get_decoder().register_forward_pre_hook(lambda *_, c=calls: c.__setitem__(0, c[0] + 1))
        try:
            ex.backward(forest, coefs)
        finally:
            hook.remove()
        runs[batching] = calls[0]
    assert runs == {True: 2, False: 16}


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("llama-gqa", {"mode": "replay"}),
        ("llama-gqa", {"prompt_grad": "none"}),
        ("llama-gqa", {"split_attention": False}),
        ("lfm2", {}),  # recurrent state
        ("mistral-swa", {}),  # sliding windows
    ],
)
def test_what_a_level_cannot_run_goes_depth_first(monkeypatch, name, kwargs):
    model = make_model(name, dtype=torch.float32)
    seqs, score_from = grpo_group()
    built = _counting(monkeypatch)
    TreeExecutor(model, **kwargs).backward(
        PrefixForest.build(seqs, score_from),
        [torch.ones(len(s) - f) for s, f in zip(seqs, score_from, strict=True)],
    )
    assert built == []


def test_memory_is_flat_in_the_number_of_groups():
    """A bundle holds as many groups' prompts as the budget allows: autograd's peak is the same
    for 12 groups as for 6."""
    model = make_model("llama-gqa", dtype=torch.float32)

    def peak(groups: int) -> int:
        g = torch.Generator().manual_seed(0)
        seqs, score_from = [], []
        for _ in range(groups):
            prompt = torch.randint(0, 61, (20,), generator=g)
            seqs += [torch.cat([prompt, torch.randint(0, 61, (6,), generator=g)]) for _ in range(4)]
            score_from += [20] * 4
        meter = SavedBytes()
        with meter.measure():
            TreeExecutor(model, leaf_batch_tokens=48).backward(
                PrefixForest.build(seqs, score_from), [torch.ones(6) for _ in seqs]
            )
        return meter.peak

    assert peak(12) <= 1.02 * peak(6)


def test_self_check_catches_a_wrong_kernel():
    """The check a device's level kernels pass before use (on a GPU at first use): the CPU's pass
    in float64 at 1e-10; a masked kernel whose log-sum-exp is off does not."""
    cpu = torch.device("cpu")
    good = level.level_kernels_for(cpu, torch.float64)
    assert level.self_check(cpu, torch.float64, good) is None

    def shifted(*args):
        out, lse = good.masked(*args)
        return out, lse + 0.5

    why = level.self_check(cpu, torch.float64, good._replace(masked=shifted))
    assert why is not None and "differs" in why


def test_cuda_kernels_fold_and_pad_exactly(monkeypatch):
    """CUDA's masked part (queries folded into their key head's group; the memory-efficient
    kernel's log-sum-exp padded to 32 queries) run here through stand-ins with that kernel's
    contract (no CUDA on this machine): the self-check passes in float64."""

    def efficient(q, k, v, bias, compute_lse, dropout, causal, scale=None):
        assert q.shape[1] == k.shape[1] and bias.shape == (*q.shape[:3], k.shape[2]) and compute_lse
        out, lse = compat.flash_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return out, torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32)), None, None

    def efficient_bwd(dout, q, k, v, bias, out, lse, seed, offset, dropout, needs, causal, scale=None):
        assert lse.shape[-1] % 32 == 0
        lse = lse[..., : q.shape[2]]
        return (
            *compat.flash_cpu_backward(dout, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale),
            None,
        )

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", efficient, raising=False)
    monkeypatch.setattr(
        torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", efficient_bwd, raising=False
    )
    cpu = level.level_kernels_for(torch.device("cpu"), torch.float64)
    cuda_like = cpu._replace(gqa=False, masked=level._cuda_masked, masked_bwd=level._cuda_masked_bwd)
    assert level.self_check(torch.device("cpu"), torch.float64, cuda_like) is None


@pytest.mark.parametrize("max_tokens", [0, 4, 64, 1 << 20])
def test_a_collapsed_plan_scores_every_entry_once(max_tokens):
    """Copying short internal nodes into their children keeps each entry in exactly one unit, each
    unit's tokens the sequences' tokens at its positions, and never makes the forest deeper."""
    from forkrl.core.tree import collapsed, plan

    seqs, score_from = _steps()
    forest = PrefixForest.build(seqs, score_from)
    units, roots = collapsed(forest, max_tokens)
    ids = torch.cat([u.entry_ids for u in units])
    assert torch.equal(ids.sort().values, torch.arange(forest.num_entries))

    def path(i: int) -> list[int]:
        u = units[i]
        return (path(u.parent) if u.parent >= 0 else []) + u.tokens.tolist()

    def depth(us, i):
        return 0 if us[i].parent < 0 else 1 + depth(us, us[i].parent)

    for i, u in enumerate(units):
        p = path(i)
        assert u.start + len(u.tokens) == len(p) and any(list(s[: len(p)]) == p for s in seqs)
    original, _ = plan(forest, None)
    deepest = max(depth(units, i) for i in range(len(units)))
    assert deepest <= max(depth(original, i) for i in range(len(original)))
    assert len(roots) == sum(1 for n in forest.nodes if n.parent < 0)
    if max_tokens == 0:  # only nodes with one child (a sequence ending there) are copied: no extra work
        free = [i for i, u in enumerate(original) if u.parent >= 0 and len(u.children) == 1]
        assert free and len(units) == len(original) - len(free)
    if max_tokens == 1 << 20:
        assert deepest == 1  # prompts, then every completion carrying what it shares below them
