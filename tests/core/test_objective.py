"""The objective bridge (``backward_loss``) against plain autograd on padded tensors, in true float64.

Every test evaluates one host loss twice: once the plain way (per-sequence forwards with grad,
padded with :func:`pad`, ``loss.backward()``), once through :func:`backward_loss` on the prefix
forest, and compares the parameter gradients, the loss value and the returned log-probs.
"""

from __future__ import annotations

import pytest
import torch

from forkrl.core import PrefixForest, RowLayout, TreeExecutor, Window
from forkrl.core.objective import TokenLocalCoefficients, backward_loss, pad, unpad
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.forests import deep_tree, grpo_group, scored_shared
from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err
from forkrl.core.testing.models import tiny_causal_lm as make_model

TOL = 1e-10
LOSS_TOL = 1e-12
EPS = 0.2
BETA = 0.04
ENT_COEF = 0.01
F64 = torch.float64

FORESTS = {"grpo": grpo_group, "deep": deep_tree, "scored_shared": scored_shared}


# ---------------------------------------------------------------------- host losses (padded layout)
def ppo_token_mean(adv, old, ref, eps=EPS, beta=BETA, ent_coef=ENT_COEF):
    """Clipped PPO/GRPO + KL k3 + entropy bonus, DAPO token-mean: sum over real tokens / their count."""

    def loss_fn(lp, ent, mask):
        m = mask.to(lp.dtype)
        n = m.sum()
        ratio = torch.exp(lp - old)
        a = adv[:, None]
        pg = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
        d = ref - lp
        k3 = torch.exp(d) - d - 1
        loss = ((pg + beta * k3) * m).sum() / n
        if ent is not None:
            loss = loss - ent_coef * (ent * m).sum() / n
        return loss

    return loss_fn


def ppo_seq_mean_token_mean(adv, old, ref, eps=EPS, beta=BETA, ent_coef=ENT_COEF):
    """The same per-token terms, averaged within each sequence, then over sequences."""

    def loss_fn(lp, ent, mask):
        m = mask.to(lp.dtype)
        n_i = m.sum(1).clamp(min=1)
        ratio = torch.exp(lp - old)
        a = adv[:, None]
        pg = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
        d = ref - lp
        per_tok = pg + beta * (torch.exp(d) - d - 1)
        if ent is not None:
            per_tok = per_tok - ent_coef * ent
        return ((per_tok * m).sum(1) / n_i).mean()

    return loss_fn


def gspo(adv, old, eps):
    """Sequence-level importance ratio exp(mean_t (lp - old)), clipped, times advantage; mean over sequences."""

    def loss_fn(lp, ent, mask):
        m = mask.to(lp.dtype)
        log_s = ((lp - old) * m).sum(1) / m.sum(1).clamp(min=1)
        s = torch.exp(log_s)
        return (-torch.minimum(s * adv, s.clamp(1 - eps, 1 + eps) * adv)).mean()

    return loss_fn


# ---------------------------------------------------------------------- setup and references
class Case:
    """A model, a forest, dense padded log-probs/entropies in the graph, and random rollout data."""

    def __init__(self, model_name, forest_name, seed=0, temperature=1.0, old_noise=0.2):
        self.model = make_model(model_name)
        self.seqs, self.score_from = FORESTS[forest_name]()
        self.forest = PrefixForest.build(self.seqs, self.score_from)
        self.temperature = temperature
        self.model.zero_grad(set_to_none=True)
        lps, ents = dense_logprobs(self.model, self.seqs, self.score_from, temperature, entropy=True)
        self.lp, self.mask = pad(lps)
        self.ent, _ = pad(ents)
        g = torch.Generator().manual_seed(seed)
        b, t = self.mask.shape
        self.adv = torch.randn(b, generator=g, dtype=F64)
        det = self.lp.detach()
        zero = torch.zeros((), dtype=F64)
        self.old = torch.where(self.mask, det + old_noise * torch.randn(b, t, generator=g, dtype=F64), zero)
        self.ref = torch.where(self.mask, det + 0.1 * torch.randn(b, t, generator=g, dtype=F64), zero)
        assert (self.adv < 0).any() and (self.adv > 0).any()

    def reference(self, loss_fn, entropy=True):
        """Plain autograd: the loss on the dense padded tensors, backpropagated once."""
        loss = loss_fn(self.lp, self.ent if entropy else None, self.mask)
        loss.backward()
        self.loss_d = loss.detach()
        self.grads_d = grads(self.model)
        return self.grads_d

    def tree(self, loss_fn, token_local, mode="keep", block=None, fill=None, entropy=True):
        self.model.zero_grad(set_to_none=True)
        ex = TreeExecutor(self.model, mode=mode, block_size=block, temperature=self.temperature)
        res = backward_loss(ex, self.forest, loss_fn, token_local=token_local, entropy=entropy, fill=fill)
        return res, grads(self.model)

    def check(self, res, g, entropy=True):
        assert max_rel_err(g, self.grads_d) < TOL
        # Every parameter that gets a gradient in the plain computation gets one here, and no other.
        assert all((a.norm() > 0) == (b.norm() > 0) for a, b in zip(g, self.grads_d, strict=True))
        assert abs(float(res.loss) - float(self.loss_d)) < LOSS_TOL
        assert not res.loss.requires_grad
        assert torch.equal(res.mask, self.mask)
        assert max_rel_err([res.logprobs[self.mask]], [self.lp.detach()[self.mask]]) < TOL
        if entropy:
            assert max_rel_err([res.entropies[self.mask]], [self.ent.detach()[self.mask]]) < TOL
        else:
            assert res.entropies is None
        # The per-sequence results agree with the padded ones.
        for i, lp_i in enumerate(res.score.logprobs):
            assert torch.equal(lp_i, res.logprobs[i, : len(lp_i)])

    def clip_counts(self, eps=EPS):
        """Real tokens where the PPO clip is active: (ratio > 1+eps, A > 0) and (ratio < 1-eps, A < 0)."""
        ratio = torch.exp(self.lp.detach() - self.old)
        a = self.adv[:, None]
        high = (self.mask & (ratio > 1 + eps) & (a > 0)).sum()
        low = (self.mask & (ratio < 1 - eps) & (a < 0)).sum()
        unclipped = (self.mask & (ratio <= 1 + eps) & (ratio >= 1 - eps)).sum()
        return int(high), int(low), int(unclipped)


# ---------------------------------------------------------------------- 1. token-local PPO/GRPO
PPO_CASES = [
    ("llama-gqa", "deep", "keep", None, 1.0),
    ("llama-gqa", "deep", "replay", 3, 1.0),
    ("llama-gqa", "deep", "packed", None, 0.7),
    ("lfm2", "grpo", "keep", None, 1.0),
]


@pytest.mark.parametrize("use_fill", [False, True], ids=["no-fill", "fill-old"])
@pytest.mark.parametrize("name,forest_name,mode,block,temperature", PPO_CASES)
def test_token_local_ppo_matches_dense(name, forest_name, mode, block, temperature, use_fill):
    with Float64Mode():
        case = Case(name, forest_name, seed=13, temperature=temperature)
        high, low, unclipped = case.clip_counts()
        # The clip really acts, in both directions, and not on every token.
        assert high >= 1 and low >= 1 and unclipped >= 1, (high, low, unclipped)
        loss_fn = ppo_token_mean(case.adv, case.old, case.ref)
        case.reference(loss_fn)
        fill = case.old if use_fill else None
        res, g = case.tree(loss_fn, token_local=True, mode=mode, block=block, fill=fill)
    case.check(res, g)


# ---------------------------------------------------------------------- 2. the two-pass path
def test_two_pass_ppo_matches_dense_and_token_local():
    with Float64Mode():
        case = Case("llama-gqa", "deep", seed=20)
        high, low, _ = case.clip_counts()
        assert high >= 1 and low >= 1
        loss_fn = ppo_token_mean(case.adv, case.old, case.ref)
        case.reference(loss_fn)
        res_tl, g_tl = case.tree(loss_fn, token_local=True, mode="keep", fill=case.old)
        out = {
            m: case.tree(loss_fn, token_local=False, mode=m, block=b)
            for m, b in (("keep", None), ("replay", 3))
        }
    case.check(res_tl, g_tl)
    for res, g in out.values():
        case.check(res, g)
        assert max_rel_err(g, g_tl) < TOL
        assert abs(float(res.loss) - float(res_tl.loss)) < LOSS_TOL


# ---------------------------------------------------------------------- 3. GSPO (coupled tokens)
def test_gspo_two_pass_matches_dense_and_token_local_does_not():
    eps = 0.05
    with Float64Mode():
        case = Case("llama-gqa", "deep", seed=13)
        loss_fn = gspo(case.adv, case.old, eps)
        m = case.mask.to(F64)
        s = torch.exp(((case.lp.detach() - case.old) * m).sum(1) / m.sum(1))
        clipped = ((s > 1 + eps) & (case.adv > 0)) | ((s < 1 - eps) & (case.adv < 0))
        # Some sequences are clipped (zero gradient), some are not.
        assert clipped.any() and not clipped.all(), s
        g_d = case.reference(loss_fn, entropy=False)
        res, g = case.tree(loss_fn, token_local=False, mode="keep", entropy=False)
        case.check(res, g, entropy=False)
        res, g = case.tree(loss_fn, token_local=False, mode="packed", entropy=False)
        case.check(res, g, entropy=False)
        # Negative control: the token-local path sees the other tokens of a sequence at their fill
        # values, so a sequence-level ratio gets the wrong coefficients.
        for fill in (case.old, None):
            _, g_wrong = case.tree(loss_fn, token_local=True, mode="keep", fill=fill, entropy=False)
            assert max_rel_err(g_wrong, g_d) > 1e-6


# ---------------------------------------------------------------------- 4. seq-mean-token-mean
@pytest.mark.parametrize("mode,block", [("keep", None), ("replay", 2)])
def test_seq_mean_token_mean_matches_dense(mode, block):
    with Float64Mode():
        case = Case("llama-gqa", "deep", seed=14)
        loss_fn = ppo_seq_mean_token_mean(case.adv, case.old, case.ref)
        case.reference(loss_fn)
        res, g = case.tree(loss_fn, token_local=True, mode=mode, block=block, fill=case.old)
        res2, g2 = case.tree(loss_fn, token_local=False, mode=mode, block=block)
    case.check(res, g)
    case.check(res2, g2)
    # The normaliser really differs from the token mean (rows have different lengths).
    assert len(set(case.mask.sum(1).tolist())) > 1


# ---------------------------------------------------------------------- 5. shared scored tokens
@pytest.mark.parametrize("token_local", [True, False], ids=["token-local", "two-pass"])
@pytest.mark.parametrize("forest_name", ["scored_shared", "deep"])
def test_shared_scored_tokens_sum_their_coefficients(forest_name, token_local):
    with Float64Mode():
        case = Case("llama-gqa", forest_name, seed=15)
        forest = case.forest
        # Some scored token is owned by several sequences.
        assert forest.num_entries < forest.scored_tokens
        loss_fn = ppo_token_mean(case.adv, case.old, case.ref)
        case.reference(loss_fn)
        res, g = case.tree(loss_fn, token_local=token_local, mode="replay", block=2)
    case.check(res, g)


@pytest.mark.parametrize("use_fill", [False, True], ids=["no-fill", "fill-old"])
@pytest.mark.parametrize("forest_name", ["scored_shared", "deep"])
def test_token_local_coefficients_are_chunking_invariant_sums(forest_name, use_fill):
    """Model-free: per-entry coefficients equal the scatter-sum of the padded loss gradient, in any chunking."""
    seqs, sf = FORESTS[forest_name]()
    forest = PrefixForest.build(seqs, sf)
    g = torch.Generator().manual_seed(16)
    e_lp = -torch.rand(forest.num_entries, generator=g, dtype=F64) * 4
    e_ent = torch.rand(forest.num_entries, generator=g, dtype=F64) * 3
    lp, mask = pad(forest.gather(e_lp))
    ent, _ = pad(forest.gather(e_ent))
    b, t = mask.shape
    zero = torch.zeros((), dtype=F64)
    old = torch.where(mask, lp + 0.3 * torch.randn(b, t, generator=g, dtype=F64), zero)
    ref = torch.where(mask, lp + 0.1 * torch.randn(b, t, generator=g, dtype=F64), zero)
    adv = torch.randn(b, generator=g, dtype=F64)
    loss_fn = ppo_token_mean(adv, old, ref)

    lp_leaf, ent_leaf = lp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    g_lp, g_ent = torch.autograd.grad(loss_fn(lp_leaf, ent_leaf, mask), [lp_leaf, ent_leaf])
    lengths = [n - s for n, s in zip(forest.lengths, forest.score_from, strict=True)]
    want_lp = forest.scatter_add(unpad(g_lp, lengths))
    want_ent = forest.scatter_add(unpad(g_ent, lengths))

    layout = RowLayout.spans(
        [forest.sequence_tokens(i) for i in range(forest.num_sequences)], forest.score_from
    )
    fill = [layout.from_host(old)] if use_fill else None
    window_loss = lambda i, lp, ent: loss_fn(lp, ent, mask)  # noqa: E731
    coef = TokenLocalCoefficients(forest, Window([layout]), window_loss, fill=fill, entropy=True)
    ids = torch.arange(forest.num_entries)
    perm = torch.randperm(forest.num_entries, generator=g)
    chunkings = [[ids], list(ids.split(1)), list(ids.split(3)), list(perm.split(4))]
    for chunks in chunkings:
        got_lp = torch.full((forest.num_entries,), float("nan"), dtype=F64)
        got_ent = got_lp.clone()
        for c in chunks:
            c_lp, c_ent = coef(c, e_lp[c], e_ent[c])
            got_lp[c], got_ent[c] = c_lp, c_ent
        assert max_rel_err([got_lp, got_ent], [want_lp, want_ent]) < 1e-13


# ---------------------------------------------------------------------- 6. NaN advantages
@pytest.mark.parametrize("token_local", [True, False], ids=["token-local", "two-pass"])
def test_nan_advantages_raise_and_accumulate_nothing(token_local):
    model = make_model("llama-gqa")
    seqs, sf = deep_tree()
    forest = PrefixForest.build(seqs, sf)
    with Float64Mode():
        lp, mask = pad(dense_logprobs(model, seqs, sf)[0])
        lp = lp.detach()
        ex = TreeExecutor(model)
        # Sequence 6's tokens are scored in the first unit of the depth-first pass, sequence 0's
        # later: a NaN found only when its chunk is reached would leave earlier chunks accumulated.
        for bad in (6, 0, len(seqs) - 1):
            adv = torch.linspace(-1, 1, len(seqs), dtype=F64)
            adv[bad] = float("nan")
            loss_fn = ppo_token_mean(adv, lp + 0.05, lp - 0.05)
            model.zero_grad(set_to_none=True)
            fill = lp if token_local else None
            with pytest.raises(ValueError, match="NaN"):
                backward_loss(ex, forest, loss_fn, token_local=token_local, entropy=True, fill=fill)
            assert all(p.grad is None for p in model.parameters()), bad


@pytest.mark.parametrize("token_local", [True, False], ids=["token-local", "two-pass"])
def test_a_loss_without_grad_is_refused_like_autograd(token_local):
    """Stock autograd raises on a loss with no grad_fn; the bridge does too, before accumulating."""
    model = make_model("llama-gqa")
    seqs, sf = deep_tree()
    forest = PrefixForest.build(seqs, sf)
    ex = TreeExecutor(model)
    model.zero_grad(set_to_none=True)
    for loss_fn in (
        lambda lp, ent, mask: (lp.detach() * mask).sum(),
        lambda lp, ent, mask: torch.tensor(1.0),
    ):
        with pytest.raises(TypeError, match="does not depend on the log-probs"):
            backward_loss(ex, forest, loss_fn, token_local=token_local)
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------------- 7. pad / unpad
@pytest.mark.parametrize("lengths", [[3, 0, 5, 1], [0, 2], [4], [0, 0]])
def test_pad_unpad_round_trip(lengths):
    g = torch.Generator().manual_seed(17)
    rows = [torch.randn(n, generator=g, dtype=F64) for n in lengths]
    padded, mask = pad(rows, value=-7.0)
    width = max(1, max(lengths))
    assert padded.shape == mask.shape == (len(lengths), width)
    assert padded.dtype == F64 and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == lengths
    assert (padded[~mask] == -7.0).all()
    back = unpad(padded, lengths)
    assert len(back) == len(rows)
    for a, b in zip(back, rows, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    # The default pad value is zero.
    assert (pad(rows)[0][~mask] == 0).all()


def test_pad_carries_gradients_to_each_row():
    """The dense references rely on ``pad`` being differentiable."""
    lengths = [2, 0, 3]
    rows = [torch.randn(n, dtype=F64, requires_grad=True) for n in lengths]
    padded, mask = pad(rows)
    w = torch.arange(1.0, 1.0 + padded.numel(), dtype=F64).reshape(padded.shape)
    (padded * w).sum().backward()
    for i, r in enumerate(rows):
        assert torch.equal(r.grad, w[i, : lengths[i]])


# ---------------------------------------------------------------------- a row that scores nothing
@pytest.mark.parametrize("token_local", [True, False], ids=["token-local", "two-pass"])
def test_sequence_scoring_nothing_gets_an_empty_row(token_local):
    seqs, sf = grpo_group()
    seqs, sf = [*seqs, seqs[0][:9]], [*sf, 9]  # a prefix of the prompt that scores nothing
    model = make_model("llama-gqa")
    forest = PrefixForest.build(seqs, sf)
    with Float64Mode():
        lps, ents = dense_logprobs(model, seqs, sf, entropy=True)
        lp, mask = pad(lps)
        ent, _ = pad(ents)
        assert mask.sum(1).tolist()[-1] == 0
        adv = torch.linspace(-1, 1, len(seqs), dtype=F64)
        det = lp.detach()
        loss_fn = ppo_seq_mean_token_mean(
            adv, torch.where(mask, det + 0.1, 0.0), torch.where(mask, det - 0.1, 0.0)
        )
        model.zero_grad(set_to_none=True)
        loss = loss_fn(lp, ent, mask)
        loss.backward()
        g_d = grads(model)
        model.zero_grad(set_to_none=True)
        res = backward_loss(TreeExecutor(model), forest, loss_fn, token_local=token_local, entropy=True)
    assert max_rel_err(grads(model), g_d) < TOL
    assert abs(float(res.loss) - loss.item()) < LOSS_TOL
    assert torch.equal(res.mask, mask)


# ---------------------------------------------------------------------- the model's device
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("token_local", [True, False], ids=["token-local", "two-pass"])
def test_loss_tensors_on_the_model_device(device, token_local):
    """The host's tensors (advantages, old log-probs) live on the model's device, as in training."""
    model = make_model("llama-gqa").to(device)
    seqs, sf = grpo_group()
    forest = PrefixForest.build(seqs, sf)
    with Float64Mode():
        lps, ents = dense_logprobs(model, [torch.tensor(s, device=device) for s in seqs], sf, entropy=True)
        lp, mask = pad(lps)
        ent, _ = pad(ents)
        assert lp.device.type == device
        det = lp.detach()
        adv = torch.linspace(-1, 1, len(seqs), dtype=F64, device=device)
        loss_fn = ppo_token_mean(adv, torch.where(mask, det + 0.1, 0.0), torch.where(mask, det - 0.1, 0.0))
        model.zero_grad(set_to_none=True)
        loss = loss_fn(lp, ent, mask)
        loss.backward()
        g_d = grads(model)
        model.zero_grad(set_to_none=True)
        res = backward_loss(TreeExecutor(model), forest, loss_fn, token_local=token_local, entropy=True)
    assert max_rel_err(grads(model), g_d) < TOL
    assert abs(float(res.loss) - loss.item()) < LOSS_TOL
    assert res.logprobs.device.type == device
