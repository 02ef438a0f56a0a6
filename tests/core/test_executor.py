"""TreeExecutor against plain per-sequence autograd, in true float64."""

from __future__ import annotations

import logging

import pytest
import torch

from forkrl.core import PrefixForest, TreeExecutor, UnsupportedModelError
from forkrl.core.compat import set_checkpointing
from forkrl.core.testing import Float64Mode
from forkrl.core.testing.forests import FORESTS, deep_tree, grpo_group
from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err
from forkrl.core.testing.models import tiny_causal_lm as make_model

TOL = 1e-10

ATTENTION_CASES = [
    ("keep", None),
    ("replay", None),
    ("replay", 1),
    ("replay", 7),
    ("replay", 1000),
    ("packed", None),
]
STATE_CASES = [("keep", None), ("replay", 1), ("replay", 7)]

MODEL_CASES = (
    [("llama-gqa", f, m, b) for f in FORESTS for m, b in ATTENTION_CASES]
    + [
        (name, "deep", m, b)
        for name in ("llama-mha", "llama-mqa", "qwen2", "qwen3")
        for m, b in ATTENTION_CASES
    ]
    + [(name, "deep", m, b) for name in ("mistral-swa", "gemma2") for m, b in STATE_CASES]
    + [
        (name, f, m, b)
        for name in ("lfm2", "qwen3next", "bamba", "nemotronh", "falconh1")
        for f in ("grpo", "deep")
        for m, b in STATE_CASES
    ]
)


def _coefs(seqs, score_from, seed):
    g = torch.Generator().manual_seed(seed)
    lp = [
        torch.randn(len(s) - f, generator=g, dtype=torch.float64)
        for s, f in zip(seqs, score_from, strict=True)
    ]
    ent = [
        torch.randn(len(s) - f, generator=g, dtype=torch.float64)
        for s, f in zip(seqs, score_from, strict=True)
    ]
    return lp, ent


def _dense(model, seqs, score_from, c_lp, c_ent, temperature=1.0):
    model.zero_grad(set_to_none=True)
    lps, ents = dense_logprobs(model, seqs, score_from, temperature, entropy=True)
    total = sum((lp * c).sum() + (e * d).sum() for lp, e, c, d in zip(lps, ents, c_lp, c_ent, strict=True))
    total.backward()
    return [t.detach() for t in lps], [t.detach() for t in ents], grads(model)


@pytest.mark.parametrize("name,forest_name,mode,block", MODEL_CASES)
def test_exact_against_dense(name, forest_name, mode, block):
    model = make_model(name)
    seqs, score_from = FORESTS[forest_name]()
    forest = PrefixForest.build(seqs, score_from)
    c_lp, c_ent = _coefs(seqs, score_from, seed=3)
    temperature = 0.7 if forest_name == "deep" else 1.0
    with Float64Mode():
        lp_d, ent_d, g_d = _dense(model, seqs, score_from, c_lp, c_ent, temperature)
        ex = TreeExecutor(model, mode=mode, block_size=block, temperature=temperature)
        scored = ex.score(forest, entropy=True)
        model.zero_grad(set_to_none=True)
        res = ex.backward(forest, c_lp, c_ent)
        g_t = grads(model)
    assert max_rel_err(scored.logprobs, lp_d) < TOL
    assert max_rel_err(scored.entropies, ent_d) < TOL
    assert max_rel_err(res.logprobs, lp_d) < TOL
    assert max_rel_err(g_t, g_d) < TOL
    # Every parameter that gets a gradient in the plain computation gets the same one here.
    assert all((a.norm() > 0) == (b.norm() > 0) for a, b in zip(g_t, g_d, strict=True))


def test_gradient_accumulates_into_existing_grads():
    model = make_model("llama-gqa")
    seqs, sf = grpo_group()
    c_lp, c_ent = _coefs(seqs, sf, 4)
    forest = PrefixForest.build(seqs, sf)
    with Float64Mode():
        _, _, g_d = _dense(model, seqs, sf, c_lp, c_ent)
        ex = TreeExecutor(model)
        model.zero_grad(set_to_none=True)
        ex.backward(forest, c_lp, c_ent)
        ex.backward(forest, c_lp, c_ent)
    assert max_rel_err(grads(model), [2 * g for g in g_d]) < TOL


def test_float32_agreement_bounds():
    model = make_model("llama-gqa", dtype=torch.float32)
    seqs, sf = deep_tree()
    c_lp, c_ent = _coefs(seqs, sf, 5)
    c_lp = [c.float() for c in c_lp]
    c_ent = [c.float() for c in c_ent]
    lp_d, ent_d, g_d = _dense(model, seqs, sf, c_lp, c_ent)
    forest = PrefixForest.build(seqs, sf)
    for mode, block in (("keep", None), ("replay", 3), ("packed", None)):
        ex = TreeExecutor(model, mode=mode, block_size=block)
        model.zero_grad(set_to_none=True)
        res = ex.backward(forest, c_lp, c_ent)
        assert max_rel_err(res.logprobs, lp_d) < 1e-5
        assert max_rel_err(grads(model), g_d) < 1e-4


def test_eager_attention_is_exact_in_every_mode():
    model = make_model("llama-gqa", attn="eager")
    seqs, sf = deep_tree()
    c_lp, c_ent = _coefs(seqs, sf, 6)
    forest = PrefixForest.build(seqs, sf)
    with Float64Mode():
        lp_d, _, g_d = _dense(model, seqs, sf, c_lp, c_ent)
        for mode, block in (("keep", None), ("replay", 2), ("packed", None)):
            model.zero_grad(set_to_none=True)
            res = TreeExecutor(model, mode=mode, block_size=block).backward(forest, c_lp, c_ent)
            assert max_rel_err(res.logprobs, lp_d) < TOL
            assert max_rel_err(grads(model), g_d) < TOL


def test_lora_model():
    peft = pytest.importorskip("peft", reason="peft is in the dev extra")
    base = make_model("llama-gqa")
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    for p in model.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.05)
    seqs, sf = grpo_group()
    c_lp, c_ent = _coefs(seqs, sf, 7)
    forest = PrefixForest.build(seqs, sf)
    with Float64Mode():
        lp_d, _, g_d = _dense(model, seqs, sf, c_lp, c_ent)
        model.zero_grad(set_to_none=True)
        res = TreeExecutor(model, mode="replay", block_size=4).backward(forest, c_lp, c_ent)
    trainable = [i for i, p in enumerate(model.parameters()) if p.requires_grad]
    assert trainable
    g_t = grads(model)
    assert max_rel_err([g_t[i] for i in trainable], [g_d[i] for i in trainable]) < TOL
    assert max_rel_err(res.logprobs, lp_d) < TOL


def test_gradient_checkpointing_is_handled_with_one_log_line(caplog):
    model = make_model("llama-gqa")
    set_checkpointing(model, True)
    model.train()
    seqs, sf = grpo_group()
    c_lp, c_ent = _coefs(seqs, sf, 8)
    forest = PrefixForest.build(seqs, sf)
    with Float64Mode():
        set_checkpointing(model, False)
        _, _, g_d = _dense(model, seqs, sf, c_lp, c_ent)
        set_checkpointing(model, True)
        ex = TreeExecutor(model, mode="keep")
        with caplog.at_level(logging.INFO, logger="forkrl.core.executor"):
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                ex.backward(forest, c_lp, c_ent)
    assert max_rel_err(grads(model), g_d) < TOL
    assert sum("gradient checkpointing" in r.message for r in caplog.records) == 1
    assert model.model.gradient_checkpointing  # restored


def test_dropout_refused_before_anything_changes():
    """A shared prefix runs once, so its dropout mask would be shared by every sequence: refused in
    every mode, naming the rate, with param.grad untouched; in eval mode the same model runs."""
    model = make_model("llama-gqa", attention_dropout=0.3)
    model.train()
    seqs, sf = deep_tree()
    c_lp, c_ent = _coefs(seqs, sf, 9)
    forest = PrefixForest.build(seqs, sf)
    for mode in ("keep", "replay", "packed"):
        model.zero_grad(set_to_none=True)
        with pytest.raises(UnsupportedModelError, match="attention_dropout=0.3"):
            TreeExecutor(model, mode=mode).backward(forest, c_lp, c_ent)
        with pytest.raises(UnsupportedModelError, match="same dropout mask"):
            TreeExecutor(model, mode=mode).score(forest)
        assert all(p.grad is None for p in model.parameters())
    model.eval()
    TreeExecutor(model, mode="keep").backward(forest, c_lp, c_ent)
    assert any(p.grad is not None for p in model.parameters())


def test_dropout_rates_a_model_does_not_read_are_not_refused():
    """GPT-2 reads its dropout rates from nn.Dropout modules: with those zeroed (TRL's
    disable_dropout) its config's rates draw nothing, and the executor runs it in training mode."""
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=61, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.2, attn_pdrop=0.2
        )
    ).train()
    seqs, sf = deep_tree()
    forest = PrefixForest.build(seqs, sf)
    with pytest.raises(UnsupportedModelError, match="attn_pdrop=0.2"):
        TreeExecutor(gpt2).score(forest)
    for m in gpt2.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ex = TreeExecutor(gpt2)
    assert ex.adapter.random_sources() == []
    ex.score(forest)


def test_packed_refused_for_state_models_and_sliding_windows():
    with pytest.raises(UnsupportedModelError, match="mode='keep'"):
        TreeExecutor(make_model("lfm2"), mode="packed")
    with pytest.raises(UnsupportedModelError, match="sliding"):
        TreeExecutor(make_model("mistral-swa"), mode="packed")
    # GPT-Neo's local layers keep full cache layers (the window is only in its mask): refused by
    # structure, since under bf16 weights the probe's tolerance would not see the window
    import transformers

    neo = transformers.GPTNeoConfig(
        vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        window_size=4, eos_token_id=0, bos_token_id=0,
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="sliding"):
        TreeExecutor(transformers.GPTNeoForCausalLM(neo), mode="packed")


def test_model_without_lm_head_is_refused():
    model = make_model("llama-gqa").model  # the bare decoder
    with pytest.raises(UnsupportedModelError, match="LlamaModel"):
        TreeExecutor(model)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mode": "dense"}, "mode"),
        ({"block_size": 0}, "block_size"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"collapse_tokens": -1}, "collapse_tokens"),
        ({"collapse_tokens": 1.5}, "collapse_tokens"),
    ],
)
def test_bad_executor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TreeExecutor(make_model("llama-gqa"), **kwargs)


def test_bad_coefficients_lose_nothing():
    model = make_model("llama-gqa")
    seqs, sf = grpo_group()
    forest = PrefixForest.build(seqs, sf)
    c_lp, _ = _coefs(seqs, sf, 10)
    ex = TreeExecutor(model)
    model.zero_grad(set_to_none=True)
    bad = [c.clone() for c in c_lp]
    bad[2][0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        ex.backward(forest, bad)
    with pytest.raises(ValueError, match="sequence 1"):
        ex.backward(forest, [c_lp[0], c_lp[1][:-1], *c_lp[2:]])
    with pytest.raises(ValueError, match="one tensor per sequence"):
        ex.backward(forest, c_lp[:-1])
    with pytest.raises(ValueError, match="exactly one"):
        ex.backward(forest)
    assert all(p.grad is None for p in model.parameters())


def test_lm_head_runs_only_at_scored_rows_in_bounded_chunks():
    model = make_model("llama-gqa")
    seqs, sf = deep_tree()
    forest = PrefixForest.build(seqs, sf)
    c_lp, c_ent = _coefs(seqs, sf, 11)
    rows_seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: rows_seen.append(i[0].shape[0]))
    limit = 3 * model.config.vocab_size  # at most 3 rows of logits at once
    try:
        with Float64Mode():
            lp_d, _, g_d = _dense(model, seqs, sf, c_lp, c_ent)
            # collapse_tokens=0: no node is copied into its children (a copy scores its own rows)
            ex = TreeExecutor(model, head_chunk_elems=limit, collapse_tokens=0).verify()  # probe not counted
            rows_seen.clear()
            model.zero_grad(set_to_none=True)
            res = ex.backward(forest, c_lp, c_ent)
    finally:
        hook.remove()
    assert max(rows_seen) <= 3
    # Each distinct predicting position is evaluated once (shared tokens are not repeated).
    assert sum(rows_seen) == sum(len(n.rows) for n in forest.nodes) < forest.scored_tokens
    assert max_rel_err(res.logprobs, lp_d) < TOL
    assert max_rel_err(grads(model), g_d) < TOL


def test_sequence_longer_than_the_model_is_refused():
    model = make_model("llama-gqa", max_position_embeddings=16)
    forest = PrefixForest.build([list(range(10)), list(range(20))], [5, 5])
    with pytest.raises(ValueError, match="sequence 1 has 20 tokens.*max_position_embeddings=16"):
        TreeExecutor(model).score(forest)


@pytest.mark.parametrize(
    "name,mode,block,group",
    [
        ("llama-gqa", "keep", None, 3),
        ("llama-gqa", "replay", 3, 3),
        ("lfm2", "replay", 4, 3),
        ("llama-gqa", "replay", 1, 1),
    ],
)
def test_prompt_grad_none_is_the_truncated_gradient(name, mode, block, group):
    """prompt_grad='none' equals the plain computation with the prompt's activations held constant
    (also for one sequence, whose prompt and response are one node: its frozen prompt blocks come
    before the blocks that need a gradient buffer)."""
    from transformers import DynamicCache

    model = make_model(name)
    seqs, sf = grpo_group(prompt=9, group=max(group, 2))
    seqs, sf = seqs[:group], sf[:group]
    P = sf[0]
    c_lp, c_ent = _coefs(seqs, sf, 12)
    forest = PrefixForest.build(seqs, sf)
    with Float64Mode():
        model.zero_grad(set_to_none=True)
        prompt = torch.as_tensor(seqs[0][:P])[None]
        with torch.no_grad():
            out = model.model(input_ids=prompt, use_cache=True)
        h_last = out.last_hidden_state[0, -1].detach()
        total = 0
        for seq, cl, ce in zip(seqs, c_lp, c_ent, strict=True):
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                model.model(input_ids=prompt, cache=cache, use_cache=True)  # a fresh constant cache
            comp = torch.as_tensor(seq[P:])[None]
            pos = torch.arange(P, len(seq))[None]
            h = model.model(input_ids=comp, position_ids=pos, cache=cache, use_cache=True).last_hidden_state[
                0
            ]
            logits = model.lm_head(torch.cat([h_last[None], h[:-1]]))
            logp = torch.log_softmax(logits, -1)
            lp = logp.gather(-1, comp[0, :, None])[:, 0]
            ent = -(logp.exp() * logp).sum(-1)
            total = total + (lp * cl).sum() + (ent * ce).sum()
        total.backward()
        g_ref = grads(model)
        model.zero_grad(set_to_none=True)
        TreeExecutor(model, mode=mode, block_size=block, prompt_grad="none").backward(forest, c_lp, c_ent)
        g_t = grads(model)
        model.zero_grad(set_to_none=True)
        TreeExecutor(model, mode=mode, block_size=block).backward(forest, c_lp, c_ent)
        g_exact = grads(model)
    assert max_rel_err(g_t, g_ref) < TOL
    assert max_rel_err(g_exact, g_ref) > 1e-6  # the exact gradient really differs


def test_prompt_grad_option_is_validated():
    model = make_model("llama-gqa")
    with pytest.raises(ValueError, match="prompt_grad"):
        TreeExecutor(model, prompt_grad="some")
    with pytest.raises(ValueError, match="mode='keep'"):
        TreeExecutor(model, mode="packed", prompt_grad="none")


@pytest.mark.parametrize(
    "name,min_piece",
    [
        ("llama-gqa", 1),
        ("llama-gqa", 1 << 10),
        ("llama-mha", 1),
        ("llama-mqa", 1),
        ("qwen2", 1),
        ("qwen3", 1),
    ],
)
def test_split_attention_is_used_and_exact(monkeypatch, name, min_piece):
    """The mask-free CPU attention runs in tree passes (scoring batches of sibling leaves too), matches
    dense, and leaves the config as it was; every ancestor as its own piece, or short ones joined."""
    import forkrl.core.attention.split as attn

    monkeypatch.setattr(attn, "MIN_PIECE", min_piece)

    calls = {"split": 0}
    real = attn._SplitAttention.apply

    def counting(*args):
        calls["split"] += 1
        return real(*args)

    monkeypatch.setattr(attn._SplitAttention, "apply", counting)
    monkeypatch.setattr(attn, "MIN_SPLIT_ELEMENTS", 0)  # split even these tiny nodes
    model = make_model(name)
    seqs, sf = deep_tree()
    c_lp, c_ent = _coefs(seqs, sf, 13)
    forest = PrefixForest.build(seqs, sf)
    with Float64Mode():
        lp_d, _, g_d = _dense(model, seqs, sf, c_lp, c_ent)
        for split in (True, False):
            calls["split"] = 0
            model.zero_grad(set_to_none=True)
            ex = TreeExecutor(model, mode="replay", block_size=3, split_attention=split)
            res = ex.backward(forest, c_lp, c_ent)
            assert max_rel_err(res.logprobs, lp_d) < TOL
            assert max_rel_err(ex.score(forest).logprobs, lp_d) < TOL
            assert max_rel_err(grads(model), g_d) < TOL
            assert (calls["split"] > 0) == split
    assert model.config._attn_implementation == "sdpa"


def _decoder_calls(model) -> tuple[dict, object]:
    calls = {"n": 0, "batches": []}

    def hook(module, args, kwargs):
        calls["n"] += 1
        calls["batches"].append(int(kwargs["input_ids"].shape[0]))

    return calls, model.get_decoder().register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3", "mistral-swa", "lfm2", "qwen3next", "bamba"])
@pytest.mark.parametrize("budget", [1, 9, 1 << 20])
def test_sibling_leaves_train_as_one_batch(name, budget):
    """Keep mode forwards and backpropagates sibling leaves as right-padded batches of at most
    ``leaf_batch_tokens`` padded tokens, exactly (attention, sliding-window and state models)."""
    model = make_model(name)
    seqs, sf = grpo_group(group=6)
    forest = PrefixForest.build(seqs, sf)
    c_lp, c_ent = _coefs(seqs, sf, 21)
    leaves = sum(1 for n in forest.nodes if not n.children)
    with Float64Mode():
        lp_d, _, g_d = _dense(model, seqs, sf, c_lp, c_ent)
        ex = TreeExecutor(model, mode="keep", leaf_batch_tokens=budget).verify()  # the probe is not counted
        model.zero_grad(set_to_none=True)
        calls, handle = _decoder_calls(model)
        try:
            res = ex.backward(forest, c_lp, c_ent)
        finally:
            handle.remove()
    assert max_rel_err(res.logprobs, lp_d) < TOL
    assert max_rel_err(grads(model), g_d) < TOL
    assert sum(calls["batches"]) == 1 + leaves  # the prompt, then every leaf once
    expected = {1: 1 + leaves, 1 << 20: 2}.get(budget)
    if expected is not None:
        assert calls["n"] == expected
    else:  # a few leaves per batch where the budget counts only the leaves (split attention)
        assert max(calls["batches"]) <= 9 and (name == "mistral-swa" or 2 < calls["n"] < 1 + leaves)


def test_sibling_batches_keep_memory_flat_in_group_size():
    """Keep mode's autograd memory is the path's plus one leaf batch's: bounded by
    ``leaf_batch_tokens`` whatever the group size."""
    from forkrl.core.testing import SavedBytes

    model = make_model("llama-gqa", dtype=torch.float32)
    R = 8

    def peak(G: int, budget: int) -> int:
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 61, (40,), generator=g)
        seqs = [torch.cat([prompt, torch.randint(0, 61, (R,), generator=g)]) for _ in range(G)]
        coefs = [torch.randn(R, generator=g) for _ in range(G)]
        meter = SavedBytes()
        with meter.measure():
            TreeExecutor(model, mode="keep", leaf_batch_tokens=budget).backward(
                PrefixForest.build(seqs, [40] * G), coefs
            )
        return meter.peak

    assert peak(16, 4 * R) <= 1.02 * peak(8, 4 * R)
    assert peak(16, 16 * R) > 1.5 * peak(16, 4 * R)  # the measure sees the batch


def test_split_kernel_self_check_catches_a_wrong_kernel():
    """The check a device's flash kernels pass before split attention uses them (on the GPU at first
    use): the CPU kernels pass it, a kernel whose log-sum-exp is off does not."""
    import forkrl.core.attention.split as attn
    from forkrl.core import compat

    good = (compat.flash_cpu, compat.flash_cpu_backward, True)
    assert attn._self_check(torch.device("cpu"), torch.float32, good) is None
    assert attn.kernels_for(torch.device("cpu"), torch.float32) == good

    def shifted(*args, **kwargs):
        out, lse = compat.flash_cpu(*args, **kwargs)[:2]
        return out, lse + 0.5

    why = attn._self_check(torch.device("cpu"), torch.float32, (shifted, compat.flash_cpu_backward, True))
    assert why is not None and "differs" in why


def test_packed_flex_block_mask_is_the_tree_mask(monkeypatch):
    """The FlexAttention BlockMask packed mode uses on CUDA (forced here, forward only: FlexAttention
    has no CPU backward) scores the forest as the dense tree mask does, through transformers'
    flex_attention; the model's attention implementation is restored after."""
    import forkrl.core.executor.packed as packed

    model = make_model("llama-gqa", dtype=torch.float32)
    seqs, sf = deep_tree()
    forest = PrefixForest.build(seqs, sf)
    want = TreeExecutor(model, mode="packed").score(forest).logprobs
    ex = TreeExecutor(model, mode="packed").verify()  # its probe on the dense mask (CPU inductor cannot
    # compile FlexAttention for the probe's 11 tokens: a torch 2.13 CPU codegen bug, not ours)
    monkeypatch.setattr(packed, "_use_flex", lambda device: True)
    calls = {"n": 0}
    real = packed._flex_block_mask

    def counted(ends):
        calls["n"] += 1
        return real(ends)

    monkeypatch.setattr(packed, "_flex_block_mask", counted)
    got = ex.score(forest).logprobs
    assert calls["n"] == 1
    assert max_rel_err(got, want) < 1e-5
    assert model.config._attn_implementation == "sdpa"


def test_a_small_broken_contract_is_refused_in_float32_too():
    """BertGenerationDecoder without ``is_decoder`` attends both ways; at tiny sizes its probe
    log-probs differ by only about 2e-3 (in float64 too): the float32 probe bound (2e-4, against
    agreement near 1e-6) must refuse it instead of letting the tree train it wrong."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertGenerationConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )  # fmt: skip
    model = transformers.BertGenerationDecoder(config)
    forest = PrefixForest.build([[3, 4, 5, 6], [3, 4, 7]], [2, 2])
    with pytest.raises(
        UnsupportedModelError, match="log-probs differ from the model's forward by [0-9.]+e-0[34]"
    ):
        TreeExecutor(model, mode="keep").score(forest)
