"""Self-speculative rollout: quantized drafter, exact batched speculative sampling, speculation policy.

Samplers are tested three ways (as vLLM's rejection-sampler tests): crafted cases with known
outcomes, seeded determinism, and the empirical distribution of the first tokens against the
model's exact distribution (enumerated), with a deliberately biased sampler as negative control.
Greedy decoding is compared token for token with Hugging Face ``generate`` in float64.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from forkrl.core.quant import QuantLinear, quantize_rtn
from forkrl.core.speculative import (
    CostModel,
    Decision,
    Drafter,
    SpeculationPolicy,
    SpeculativeSampler,
    expected_tokens,
    greedy_accept,
    predicted_speedup,
    speculative_accept,
    warp_logits,
)
from forkrl.core.testing.models import tiny_causal_lm as make_model
from tests.stats import chi_square_pvalue

# Intermediate 64 so every in_features (32, 64) fits int4 group size 32.
SIZES = dict(intermediate_size=64)


def left_padded_batch(seed: int = 1, bsz: int = 4, plen: int = 6, vocab: int = 61):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (bsz, plen), generator=g)
    mask = torch.ones(bsz, plen, dtype=torch.long)
    for b, pad in enumerate([0, 3, 1, 5][:bsz]):
        mask[b, :pad] = 0
    ids[mask == 0] = 0
    return ids, mask


class ScriptedPolicy(SpeculationPolicy):
    """Draft lengths from a fixed script (0 = plain), cycling: exercises every cache transition."""

    def __init__(self, script):
        super().__init__(fixed_k=max(script))
        self.script, self.i = list(script), 0

    def decide(self, batch_size, max_k=None, **kwargs):
        k = self.script[self.i % len(self.script)]
        self.i += 1
        return Decision(min(k, max(max_k or 0, 0)), float("nan"), self.alpha, batch_size)


# ----------------------------------------------------------------------------- quantization


@pytest.mark.parametrize(
    "bits,group,symmetric", [(4, 32, False), (4, 64, True), (8, 64, False), (8, 64, True)]
)
def test_quantize_rtn_error_is_within_half_a_step(bits, group, symmetric):
    w = torch.randn(48, 128, dtype=torch.float64) * torch.rand(48, 1, dtype=torch.float64) * 3
    codes, scale, offset = quantize_rtn(w, bits, group, symmetric)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= (1 << bits) - 1
    mid = 1 << (bits - 1)
    deq = ((codes.double().reshape(48, -1, group) - mid) * scale[..., None] + offset[..., None]).reshape(
        48, 128
    )
    step = scale.repeat_interleave(group, 1)
    # Round to nearest: every weight within half a quantization step (float32 slack).
    assert bool(((deq - w).abs() <= step / 2 + 1e-5 * w.abs().max()).all())
    if symmetric:
        assert bool((offset == 0).all())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kernel", ["native", "dequant"])
def test_quant_linear_computes_with_its_dequantized_weight(bits, kernel):
    torch.manual_seed(0)
    lin = nn.Linear(64, 40, bias=True)  # 40 rows: int4 pads them to 48 internally
    q = QuantLinear(64, 40, bits=bits, group_size=32, bias=True, kernel=kernel, out_dtype=torch.float32)
    q.load_(lin.weight, lin.bias)
    assert q.kernel == kernel
    x = torch.randn(3, 5, 64)
    want = x @ q.dequantize().t() + lin.bias.detach()
    got = q(x)
    assert got.shape == (3, 5, 40) and got.dtype == torch.float32
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())  # bf16 activations
    # ...and the dequantized weight is the policy's up to the quantization error.
    rel = float((q.dequantize() - lin.weight.detach()).norm() / lin.weight.detach().norm())
    assert rel < (0.12 if bits == 4 else 0.01)


def test_low_bit_kernels_exist_on_this_machine():
    # The drafter must run torch's real low-bit ops here, not the dequantize fallback.
    for bits in (4, 8):
        assert QuantLinear(128, 32, bits=bits, group_size=128).kernel == "native"


def tiny_llama(tied: bool, seed: int = 0, vocab: int = 61, **over) -> LlamaForCausalLM:
    config = {**SIZES, "vocab_size": vocab, "tie_word_embeddings": tied, **over}
    return make_model("llama-gqa", dtype=torch.float32, seed=seed, **config)


def storages(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in itertools.chain(module.parameters(), module.buffers())}


@pytest.mark.parametrize("tied", [True, False])
def test_drafter_is_an_independent_quantized_copy(tied):
    policy = tiny_llama(tied)
    assert (policy.lm_head.weight is policy.model.embed_tokens.weight) == tied
    drafter = Drafter.from_policy(policy, bits=4, group_size=32)
    linears = [n for n, m in policy.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(drafter.quantized) == sorted(linears)  # projections, MLP and the LM head
    assert not any(isinstance(m, nn.Linear) for m in drafter.model.modules())
    assert drafter.kernels == {"native": len(linears)}
    assert not storages(policy) & storages(drafter.model)  # nothing shared
    assert not any(p.requires_grad for p in drafter.model.parameters())
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        p = policy(ids).logits.softmax(-1)
        q = drafter(input_ids=ids).logits.float().softmax(-1)
    tv = float((p - q).abs().sum(-1).max() / 2)
    assert 0 < tv < 0.05
    report = drafter.memory_report(policy)
    assert (
        report["drafter_bytes"] == drafter.memory_bytes() == report["quantized_bytes"] + report["dense_bytes"]
    )
    assert report["overhead_fraction"] < 0.5


def test_refresh_requantizes_in_place():
    policy = tiny_llama(tied=True)
    drafter = Drafter.from_policy(policy, bits=4, group_size=32)
    before = {
        n: t.data_ptr()
        for n, t in itertools.chain(drafter.model.named_parameters(), drafter.model.named_buffers())
    }
    old_head = drafter.quantized["lm_head"].scales_and_zeros.clone()
    with torch.no_grad():  # a "policy update"
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert drafter.refresh(policy) is drafter
    after = {
        n: t.data_ptr()
        for n, t in itertools.chain(drafter.model.named_parameters(), drafter.model.named_buffers())
    }
    assert after == before  # no reallocation
    assert not torch.equal(drafter.quantized["lm_head"].scales_and_zeros, old_head)
    fresh = Drafter.from_policy(policy, bits=4, group_size=32)
    for (n, a), (_, b) in zip(
        drafter.model.state_dict().items(), fresh.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), n  # identical to a drafter built from the updated policy


def test_drafter_refuses_what_the_kernels_cannot_run():
    policy = tiny_llama(tied=False, intermediate_size=48)
    with pytest.raises(
        ValueError, match=r"model.layers.0.mlp.down_proj.*in_features=48.*group_size=32.*use bits=8"
    ):
        Drafter.from_policy(policy, bits=4, group_size=32)
    ok = tiny_llama(tied=False)
    with pytest.raises(ValueError, match="not divisible by group_size=64.*group_size in \\[32\\]"):
        Drafter.from_policy(ok, bits=4, group_size=64)
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        Drafter.from_policy(ok, bits=3)
    with pytest.raises(ValueError, match="group_size=16 is not supported"):
        Drafter.from_policy(ok, bits=4, group_size=16)
    with pytest.raises(ValueError, match="int8 is per-channel"):
        Drafter.from_policy(ok, bits=8, group_size=32)
    drafter = Drafter.from_policy(ok, bits=8)
    with pytest.raises(ValueError, match="differ from the policy"):
        drafter.refresh(tiny_llama(tied=False, vocab=64))


# ----------------------------------------------------------------------------- distributions


def test_warp_matches_hugging_face_warpers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g)
    logits[:, 10:14] = logits[:, 10:11]  # ties at the top-k boundary
    for t, k, p in [(1.0, None, None), (0.7, 5, None), (1.0, None, 0.8), (1.3, 12, 0.6), (0.5, 1, 0.3)]:
        want = logits
        if t != 1.0:
            want = TemperatureLogitsWarper(t)(None, want)
        if k:
            want = TopKLogitsWarper(k)(None, want)
        if p is not None:
            want = TopPLogitsWarper(p)(None, want)
        assert torch.equal(warp_logits(logits, t, k, p), want)


def test_accept_crafted_cases():
    g = torch.Generator().manual_seed(0)
    v = 6
    q = torch.softmax(torch.randn(500, 3, v, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, v), 1, generator=g).reshape(500, 3)
    # p == q: every draft is accepted and the bonus comes from p_{k+1}.
    p = torch.cat([q, torch.full((500, 1, v), 1 / v)], 1)
    n, nxt = speculative_accept(drafts, q, p, g)
    assert bool((n == 3).all())
    # p puts no mass on the drafted token at position 0: rejected there, and the correction
    # comes from max(0, p - q), which here is p restricted to tokens q underweights.
    p = torch.zeros(500, 4, v)
    p[:, :, 5] = 1.0
    q2 = torch.full((500, 3, v), 1 / v)
    d2 = torch.zeros(500, 3, dtype=torch.long)  # token 0: p(0) = 0
    n, nxt = speculative_accept(d2, q2, p, g)
    assert bool((n == 0).all()) and bool((nxt == 5).all())
    # Greedy: keep the drafts equal to the target argmax, then the argmax after them.
    logits = torch.tensor([[[0.0, 1, 0], [2, 0, 0], [0, 0, 3]]])
    assert [t.tolist() for t in greedy_accept(torch.tensor([[1, 1]]), logits)] == [[1], [0]]
    assert [t.tolist() for t in greedy_accept(torch.tensor([[1, 0]]), logits)] == [[2], [2]]


def test_accept_residual_distribution():
    # One position, many rows: the emitted token must be distributed as p exactly.
    g = torch.Generator().manual_seed(3)
    p1 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rows = 40000
    q = q1.expand(rows, 1, 4)
    drafts = torch.multinomial(q1, rows, replacement=True, generator=g)[:, None]
    p = torch.stack([p1, torch.tensor([1.0, 0, 0, 0])]).expand(rows, 2, 4)
    n, nxt = speculative_accept(drafts, q, p, g)
    first = torch.where(n == 1, drafts[:, 0], nxt)
    freq = torch.bincount(first, minlength=4).double() / rows
    assert float((freq - p1.double()).abs().max()) < 0.01
    # Acceptance rate is 1 - TV(p, q).
    assert abs(float(n.double().mean()) - (1 - 0.5 * float((p1 - q1).abs().sum()))) < 0.01


# ----------------------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
@pytest.mark.parametrize("with_eos", [False, True])
def test_greedy_matches_hf_generate(name, with_eos):
    model = make_model(name, **SIZES)
    model.generation_config.eos_token_id = None
    drafter = Drafter.from_policy(model, bits=4, group_size=32)
    ids, mask = left_padded_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    want = model.generate(**kwargs, eos_token_id=None)
    eos = int(want[1, 6 + 5]) if with_eos else None  # a token the model does emit mid-completion
    if with_eos:
        want = model.generate(**kwargs, eos_token_id=eos)
        assert want.shape[1] < 6 + 16 or (want[:, 6:] == eos).sum() > 0
    auto = SpeculationPolicy.from_timings(
        [1, 8], {1: [1.0, 1.0], 3: [1.1, 2.0]}, {1: [0.2, 1.0], 2: [0.2, 1.0]}
    )
    for policy in [SpeculationPolicy.never(), SpeculationPolicy.fixed(1), SpeculationPolicy.fixed(4),
                   ScriptedPolicy([2, 0, 0, 3, 1, 0, 6]), auto]:  # fmt: skip
        sampler = SpeculativeSampler(model, drafter if policy.mode != "never" else None, policy)
        out = sampler.generate(
            ids,
            mask,
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=[] if eos is None else eos,
            pad_token_id=0,
        )
        assert out.sequences.shape == want.shape, policy.mode
        assert torch.equal(out.sequences, want), (policy.mode, out.stats.draft_length_history)
        if eos is None:
            assert out.completion_lengths.tolist() == [16] * 4


def test_eos_lengths_and_padding():
    model = make_model("llama-gqa", **SIZES)
    drafter = Drafter.from_policy(model, bits=4, group_size=32)
    ids, mask = left_padded_batch()
    sampler = SpeculativeSampler(model, drafter, SpeculationPolicy.fixed(3))
    out = sampler.generate(ids, mask, max_new_tokens=16, temperature=0, eos_token_id=5, pad_token_id=60)
    comp = out.sequences[:, 6:]
    assert torch.equal(out.sequences[:, :6], ids)
    for b, n in enumerate(out.completion_lengths.tolist()):
        assert (comp[b, : n - 1] != 5).all()  # no EOS before the end
        assert comp[b, n - 1] == 5 or n == 16  # ends with EOS or at the budget
        assert (comp[b, n:] == 60).all()  # right-padded
    assert comp.shape[1] == int(out.completion_lengths.max())
    one = sampler.generate(ids, mask, max_new_tokens=1, temperature=0, eos_token_id=[])
    assert one.sequences.shape == (4, 7) and one.completion_lengths.tolist() == [1, 1, 1, 1]


def test_generation_config_supplies_eos_and_pad():
    model = make_model("llama-gqa", **SIZES)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 5, 60
    sampler = SpeculativeSampler(model, Drafter.from_policy(model, bits=4, group_size=32))
    ids, mask = left_padded_batch()
    out = sampler.generate(ids, mask, max_new_tokens=16, temperature=0)
    explicit = sampler.generate(ids, mask, max_new_tokens=16, temperature=0, eos_token_id=5, pad_token_id=60)
    assert torch.equal(out.sequences, explicit.sequences)
    assert (out.completion_lengths < 16).any()


def test_wrapped_model_and_refresh_between_calls():
    class Wrapper(nn.Module):  # what DDP / DeepSpeed engines look like: the model under .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = make_model("llama-gqa", **SIZES)
    model.generation_config.eos_token_id = None
    drafter = Drafter.from_policy(Wrapper(model), bits=4, group_size=32)
    sampler = SpeculativeSampler(Wrapper(model), drafter, SpeculationPolicy.fixed(3))
    ids, mask = left_padded_batch()
    kwargs = dict(max_new_tokens=12, temperature=0, eos_token_id=[])
    first = sampler.generate(ids, mask, **kwargs)
    with torch.no_grad():  # an optimizer step on the policy, then the drafter follows it
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    drafter.refresh(Wrapper(model))
    second = sampler.generate(ids, mask, **kwargs)
    want = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0
    )
    assert torch.equal(second.sequences, want) and not torch.equal(first.sequences, second.sequences)


# ----------------------------------------------------------------------------- sampling


def test_seeded_runs_are_deterministic():
    model = make_model("qwen2", **SIZES)
    sampler = SpeculativeSampler(
        model, Drafter.from_policy(model, bits=4, group_size=32), ScriptedPolicy([3, 0, 2])
    )
    ids, mask = left_padded_batch()

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        sampler.policy.i = 0
        return sampler.generate(
            ids, mask, max_new_tokens=12, top_k=20, generator=g, eos_token_id=[]
        ).sequences

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def peaked_model(seed: int, vocab: int = 8) -> LlamaForCausalLM:
    """A tiny model with a far-from-uniform next-token distribution (large initial weights)."""
    return tiny_llama(tied=False, seed=seed, vocab=vocab, initializer_range=0.5).double()


def exact_joint(model, prompt, steps, temperature, top_k, top_p) -> torch.Tensor:
    """P(t_1..t_steps | prompt) for every token tuple, by enumeration, warped as generate does."""
    vocab = model.config.vocab_size
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = torch.zeros(1, 0, dtype=torch.long)
    for _ in range(steps):
        ids = torch.cat([prompt.expand(prefixes.shape[0], -1), prefixes], 1)
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float()
        probs = warp_logits(logits, temperature, top_k, top_p).softmax(-1).double()
        joint = (joint[:, None] * probs).reshape(-1)
        prefixes = torch.cat(
            [prefixes.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(prefixes.shape[0])[:, None]], 1
        )
    return joint  # [vocab ** steps], index = t_1 * V^(steps-1) + ...


class AcceptAll(SpeculativeSampler):
    """Negative control: keeps every draft (so the output follows the drafter, not the model)."""

    def _accept(self, drafts, q, p, generator):
        k = drafts.shape[1]
        nxt = torch.multinomial(p[:, k], 1, generator=generator)[:, 0]
        return torch.full_like(drafts[:, 0], k), nxt


@pytest.mark.parametrize(
    "temperature,top_k,top_p,k",
    [(1.0, None, None, 2), (0.7, 4, None, 1), (1.0, None, 0.8, 2)],
    ids=["t1", "t0.7-topk4", "topp0.8"],
)
def test_sampled_distribution_is_the_models(temperature, top_k, top_p, k):
    vocab, steps, rows = 8, 3, 4000
    target = peaked_model(seed=0, vocab=vocab)
    # The drafter of a policy one (noisy) update behind: with int4 rounding on these large weights
    # about a third of the drafts are rejected, so accepted, residual and bonus draws all occur,
    # and a sampler that follows the drafter is far enough off to be detected.
    stale = copy.deepcopy(target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in stale.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1 * p.std())
    drafter = Drafter.from_policy(stale, bits=4, group_size=32)
    prompt = torch.tensor([[3, 1, 4, 1]])
    probs = exact_joint(target, prompt, steps, temperature, top_k, top_p)

    def counts(sampler_cls) -> torch.Tensor:
        sampler = sampler_cls(target, drafter, SpeculationPolicy.fixed(k))
        out = sampler.generate(
            prompt.expand(rows, -1),
            max_new_tokens=steps + 1,  # so that a k=2 step covers tokens 2 and 3
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=[],
            generator=torch.Generator().manual_seed(7),
        )
        comp = out.sequences[:, prompt.shape[1] : prompt.shape[1] + steps]
        idx = (comp * torch.tensor([vocab**2, vocab, 1])).sum(-1)
        return torch.bincount(idx, minlength=vocab**steps), out.stats

    got, stats = counts(SpeculativeSampler)
    assert stats.draft_length_history[0] == k
    assert 0.1 < stats.acceptance_rate < 0.95  # both branches (accept, residual) exercised
    p_value = chi_square_pvalue(got, probs)
    tv = 0.5 * float((got / rows - probs).abs().sum())
    biased, _ = counts(AcceptAll)
    p_biased = chi_square_pvalue(biased, probs)
    tv_biased = 0.5 * float((biased / rows - probs).abs().sum())
    print(
        f"p={p_value:.3g} tv={tv:.4f} | accept-all: p={p_biased:.3g} tv={tv_biased:.4f} acc={stats.acceptance_rate:.2f}"
    )
    assert p_value > 1e-3, (p_value, tv)
    assert p_biased < 1e-9, (p_biased, tv_biased)  # the test has the power to see a wrong sampler
    assert tv < tv_biased


# ----------------------------------------------------------------------------- policy


def test_expected_tokens_and_speedup_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12  # 1 + 0.5 + 0.25
    # 1.75 tokens for (first draft 0.3 + one more draft 0.2 + verify 1.2) vs 1.0 per plain token.
    assert abs(predicted_speedup(0.5, 2, 1.0, 1.2, 0.3, 0.2) - 1.75 / 1.7) < 1e-12


def _schedule_policy() -> SpeculationPolicy:
    # Drafting pays at small batches and not at large ones (the drafter's cost grows to the target's).
    return SpeculationPolicy.from_timings(
        [1, 64],
        {
            1: [1.0, 4.0],
            2: [1.05, 7.0],
            3: [1.1, 10.0],
            4: [1.15, 13.0],
            5: [1.2, 16.0],
            7: [1.3, 22.0],
            9: [1.4, 28.0],
        },
        {1: [0.1, 4.0], 2: [0.11, 7.0]},
        alpha_init=0.9,
        margin=0.05,
    )


def test_policy_speculates_only_where_it_pays():
    policy = _schedule_policy()
    small, big = policy.decide(1), policy.decide(64)
    assert small.k > 2 and small.speedup > 2
    assert big.k == 0 and big.speedup < 1.05
    # The draft length follows the acceptance estimate down the ladder, then speculation stops.
    ks = []
    for _ in range(30):
        policy.observe(accepted=1, rejected=9)
        ks.append(policy.decide(1).k)
    assert policy.alpha < 0.2 and ks[0] <= small.k and ks[-1] == 0
    assert all(a >= b for a, b in itertools.pairwise(ks)) and len(set(ks)) > 2
    assert policy.decide(1, max_k=0).k == 0
    # Turning on costs a drafter catch-up over `lag` tokens: only worth it with enough budget left.
    policy.alpha = 0.9
    assert policy.decide(1, lag=100, horizon=1).k == 0
    assert policy.decide(1, lag=100, horizon=1000).k == small.k
    # Hysteresis: a gain between 1 + margin / 2 and 1 + margin keeps speculation on, but does not
    # turn it on.
    gain = policy.decide(1).speedup
    policy.margin = (gain - 1) * 1.5
    assert policy.decide(1, lag=2).k > 0 and policy.decide(1, lag=3).k == 0
    cm = policy.cost_model
    assert abs(cm.target(32, 1) - (1.0 + 3.0 * 31 / 63)) < 1e-9  # linear in the batch between grid points
    assert cm.table(0.9)[0]["best_k"] == small.k and cm.table(0.9)[1]["speedup"] < 1


def test_batch_schedule_is_the_policys_choice_per_batch_size():
    """The table an engine takes at start (vLLM's per-batch-size draft lengths): decide() per batch size,
    as contiguous inclusive ranges covering 1..max_batch."""
    policy = _schedule_policy()
    schedule = policy.batch_schedule(64)
    assert schedule[0][0] == 1 and schedule[-1][1] == 64
    assert all(a[1] + 1 == b[0] and a[2] != b[2] for a, b in itertools.pairwise(schedule))
    for first, last, k in schedule:
        assert all(policy.decide(b).k == k for b in range(first, last + 1))
    assert schedule[0][2] == policy.decide(1).k > 0 and schedule[-1][2] == 0
    assert SpeculationPolicy.fixed(3).batch_schedule(8) == [(1, 8, 3)]
    with pytest.raises(ValueError, match="max_batch"):
        policy.batch_schedule(0)


def test_policy_and_cost_model_validation():
    with pytest.raises(ValueError, match="needs a cost model"):
        SpeculationPolicy()
    with pytest.raises(ValueError, match="ascending"):
        CostModel([4, 1], {1: [1, 1]}, {1: [1, 1]})
    with pytest.raises(ValueError, match="3 timings for 2 batch sizes"):
        CostModel([1, 4], {1: [1, 1, 1]}, {1: [1, 1]})
    with pytest.raises(ValueError, match="n=1"):
        CostModel([1, 4], {2: [1, 1]}, {1: [1, 1]})
    with pytest.raises(ValueError, match="never"):
        SpeculationPolicy.fixed(0)


def test_calibrate_times_both_models():
    model = make_model("llama-gqa", dtype=torch.float32, **SIZES)
    drafter = Drafter.from_policy(model, bits=4, group_size=32)
    policy = SpeculationPolicy.calibrate(
        model, drafter, batch_sizes=(1, 4), context_len=16, repeats=1, progress=False, ladder=(1, 2)
    )
    cm = policy.cost_model
    assert sorted(cm.target_s) == [1, 2, 3] and sorted(cm.draft_s) == [1, 2, 16]
    assert all(t > 0 for ts in [*cm.target_s.values(), *cm.draft_s.values()] for t in ts)
    assert isinstance(policy.decide(2), Decision)


def test_stats_are_consistent():
    model = make_model("llama-gqa", **SIZES)
    sampler = SpeculativeSampler(
        model, Drafter.from_policy(model, bits=4, group_size=32), ScriptedPolicy([2, 0])
    )
    ids, mask = left_padded_batch()
    s = sampler.generate(
        ids, mask, max_new_tokens=9, eos_token_id=[], generator=torch.Generator().manual_seed(0)
    ).stats
    hist = s.draft_length_history
    assert len(hist) == len(s.batch_size_history) == len(s.decisions) and set(hist) <= {0, 2}
    assert s.target_calls == 1 + len(hist)  # prefill + one per decode step
    assert s.drafter_calls == 2 * hist.count(2)
    assert s.proposed == sum(k * b for k, b in zip(hist, s.batch_size_history, strict=True))
    assert 0 <= s.accepted <= s.proposed and s.generated_tokens == 4 * 9
    assert s.speculated_fraction == hist.count(2) / len(hist)
    assert 1 <= s.mean_accepted_length <= 3 and s.kernel == "int4-native"
    assert all(isinstance(v, float) for v in s.as_metrics().values())


# ----------------------------------------------------------------------------- errors


def test_bad_inputs_say_what_to_do():
    model = make_model("llama-gqa", **SIZES)
    sampler = SpeculativeSampler(model, Drafter.from_policy(model, bits=4, group_size=32))
    ids, mask = left_padded_batch()
    with pytest.raises(ValueError, match="empty prompt"):
        sampler.generate(ids[:, :0], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        sampler.generate(ids, mask, max_new_tokens=0)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        sampler.generate(ids, mask[:, 1:], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"\[batch, prompt_len\]"):
        sampler.generate(ids[0], max_new_tokens=4)
    bad = mask.clone()
    bad[2] = 0
    with pytest.raises(ValueError, match=r"rows \[2\].*all padding"):
        sampler.generate(ids, bad, max_new_tokens=4)
    with pytest.raises(ValueError, match="top_p"):
        sampler.generate(ids, mask, max_new_tokens=4, top_p=1.5)
    other_vocab = make_model("llama-gqa", vocab_size=64, **SIZES)
    with pytest.raises(ValueError, match="vocab_size=64"):
        SpeculativeSampler(model, Drafter.from_policy(other_vocab, bits=4, group_size=32))
    other_arch = make_model("qwen2", **SIZES)
    with pytest.raises(ValueError, match="different parameter names"):
        SpeculativeSampler(model, Drafter.from_policy(other_arch, bits=4, group_size=32))
    with pytest.raises(ValueError, match="a drafter is needed"):
        SpeculativeSampler(model, None, SpeculationPolicy.fixed(2))


def test_unsupported_models_are_refused():
    swa = make_model("mistral-swa", **SIZES)
    with pytest.raises(ValueError, match="full-attention decoder models only"):
        SpeculativeSampler(swa, None, SpeculationPolicy.never())
    model = make_model("llama-gqa", **SIZES)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        SpeculativeSampler(model, None, SpeculationPolicy.never())


def test_eager_attention_matches_sdpa():
    ids, mask = left_padded_batch()
    outs = []
    for attn in ("sdpa", "eager"):
        model = make_model("llama-gqa", attn=attn, **SIZES)
        sampler = SpeculativeSampler(
            model, Drafter.from_policy(model, bits=4, group_size=32), ScriptedPolicy([3, 0])
        )
        outs.append(sampler.generate(ids, mask, max_new_tokens=10, temperature=0, eos_token_id=[]).sequences)
    assert torch.equal(outs[0], outs[1])
