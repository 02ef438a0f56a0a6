"""The correctness stages of ``scripts/gpu_check.py`` (unchanged in what they check since the
first GPU runs, benchmarks/results/gpu.md): env, ops, attention, exactness, precision,
long_context, drafter. ``ctx.tiny`` selects the CPU smoke sizes."""

from __future__ import annotations

import platform
import time
from contextlib import contextmanager

# ---------------------------------------------------------------------------- helpers


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device, fn):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


@contextmanager
def _peak(device, box: dict, key: str):
    """Peak device memory (MB) above the start of the block, into ``box[key]``."""
    import torch

    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    try:
        yield
    finally:
        torch.cuda.synchronize(device)
        box[key] = (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _rel(got, want) -> float:
    got = [g.detach().double().cpu() for g in got]
    want = [w.detach().double().cpu() for w in want]
    scale = max(float(w.norm()) for w in want) or 1.0
    return max(float((g - w).norm()) for g, w in zip(got, want, strict=True)) / scale


def free(device) -> None:
    """Between stages only (never between a warm-up and its timing)."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- stages


def stage_env(ctx) -> dict:
    import torch
    import transformers

    dev = ctx.device
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "forkrl": ctx.forkrl_source,
        "device": str(dev),
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        out.update(
            name=props.name,
            memory_gib=props.total_memory / 2**30,
            capability=list(
                props.major_minor() if hasattr(props, "major_minor") else (props.major, props.minor)
            ),
        )
        out["flash_sdp"] = torch.backends.cuda.flash_sdp_enabled()
        out["mem_efficient_sdp"] = torch.backends.cuda.mem_efficient_sdp_enabled()
    ops = ("_scaled_dot_product_flash_attention", "_flash_attention_forward", "_efficient_attention_forward")
    out["aten_ops"] = {name: hasattr(torch.ops.aten, name) for name in ops}
    try:
        from torch.nn.attention import flex_attention  # noqa: F401

        out["flex_attention"] = True
    except ImportError:
        out["flex_attention"] = False
    from .wheels import versions

    out["packages"] = versions(
        "accelerate",
        "peft",
        "pyarrow",
        "fsspec",
        "huggingface-hub",
        "datasets",
        "dill",
        "multiprocess",
        "trl",
        "prefix-grouper",
    )
    out["carried_wheels"] = ctx.wheels
    return out


def _reference_attention(q, k, v, causal: bool, scale: float):
    """float64 attention with bottom-right causal alignment; ``[B, H, q, d]`` out and ``[B, H, q]`` lse."""
    import torch

    q, k, v = q.double(), k.double(), v.double()
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        ql, kl = q.shape[2], k.shape[2]
        mask = torch.arange(ql, device=q.device)[:, None] + (kl - ql) >= torch.arange(kl, device=q.device)
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse


def stage_ops(ctx) -> dict:
    """The flash kernel forkrl's split attention calls on this device, against float64."""
    import torch

    from forkrl.core.attention import split as attn

    dev = ctx.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kernels = attn.kernels_for(dev, dtype)
    if kernels is None:
        return {"status": "skipped", "why": f"no split-attention kernel for {dev} {dtype}"}
    fwd, bwd, gqa = kernels
    g = torch.Generator(device="cpu").manual_seed(0)
    out = {"dtype": str(dtype), "gqa_in_kernel": gqa}
    for name, (b, h, kv, ql, kl, causal) in {
        "causal_self": (2, 8, 8, 128, 128, True),
        "unmasked_past": (1, 4, 4, 512, 1024, False),
        "causal_fewer_queries": (1, 4, 4, 64, 256, True),
    }.items():
        q = torch.randn(b, h, ql, 64, generator=g).to(dev, dtype)
        k = torch.randn(b, kv, kl, 64, generator=g).to(dev, dtype)
        v = torch.randn(b, kv, kl, 64, generator=g).to(dev, dtype)
        scale = 64**-0.5
        o, lse = fwd(q, k, v, 0.0, causal, scale=scale)
        o_ref, lse_ref = _reference_attention(q, k, v, causal, scale)
        if causal and ql < kl:  # which alignment the kernel uses (the split never relies on it)
            o_top, _ = _reference_attention(q, k[:, :, :ql], v[:, :, :ql], True, scale)
            out[f"{name}/top_left_err"] = _rel([o], [o_top])
        dout = torch.randn_like(o)
        dq, dk, dv = bwd(dout, q, k, v, o, lse, 0.0, causal, scale=scale)
        qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        o2, _ = _reference_attention(qr, kr, vr, causal, scale)
        o2.backward(dout.double())
        out[name] = {
            "lse_shape": list(lse.shape),
            "out_err": _rel([o], [o_ref]),
            "lse_err": _rel([lse], [lse_ref]),
            "grad_err": _rel([dq, dk, dv], [qr.grad, kr.grad, vr.grad]),
        }
    # The level pass's kernels (a masked ancestor depth, a broadcast one, GQA) against float64:
    # where this fails, keep mode runs depth first on this device.
    from forkrl.core.attention import level

    levels = level.LevelKernels(*kernels, level._cuda_masked, level._cuda_masked_bwd)
    if dev.type != "cuda":
        levels = level.level_kernels_for(dev, dtype)
    why = level.self_check(dev, dtype, levels)
    out["level_kernels"] = "ok" if why is None else why
    return out


def stage_attention(ctx) -> dict:
    """forkrl's split attention (a batch of siblings over shared pieces, GQA) against sdpa with a mask."""
    import torch

    from forkrl.core.attention import PastPieces, split_attention
    from forkrl.core.attention import split as attn

    dev = ctx.device
    out = {}
    for dtype in (torch.bfloat16, torch.float32) if dev.type == "cuda" else (torch.float32,):
        g = torch.Generator(device="cpu").manual_seed(1)
        b, h, kv, ql, d, pieces = 4, 8, 2, 96, 64, (700, 300)
        q = torch.randn(b, h, ql, d, generator=g).to(dev, dtype).requires_grad_(True)
        ks = torch.randn(b, kv, ql, d, generator=g).to(dev, dtype).requires_grad_(True)
        vs = torch.randn(b, kv, ql, d, generator=g).to(dev, dtype).requires_grad_(True)
        kp = [torch.randn(1, kv, n, d, generator=g).to(dev, dtype).requires_grad_(True) for n in pieces]
        vp = [torch.randn(1, kv, n, d, generator=g).to(dev, dtype).requires_grad_(True) for n in pieces]
        key = ks.view_as(ks)
        key.forkrl_past = PastPieces(kp, vp)
        o, _ = split_attention(None, q, key, vs, None, scaling=d**-0.5)
        dout = torch.randn_like(o)
        leaves = [q, ks, vs, *kp, *vp]
        got = torch.autograd.grad(o, leaves, dout)
        # Reference: float64, the context expanded per sequence, a bottom-right causal mask.
        ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
        ref = attn.reference_attention(*ref_leaves[:3], ref_leaves[3:5], ref_leaves[5:], d**-0.5)
        ref = ref.transpose(1, 2)  # split_attention returns [b, q, h, d]
        want = torch.autograd.grad(ref, ref_leaves, dout.double())
        out[str(dtype)] = {
            "kernel": "split" if attn.kernels_for(dev, dtype) is not None else "fallback (sdpa with a mask)",
            "out_err": _rel([o], [ref]),
            "grad_err": _rel(got, want),
        }
    return out


def stage_exactness(ctx) -> dict:
    import torch

    from forkrl.core import PrefixForest, TreeExecutor
    from forkrl.core.testing.forests import deep_tree, grpo_group
    from forkrl.core.testing.models import dense_logprobs
    from forkrl.core.testing.models import tiny_causal_lm as make_model

    dev = ctx.device
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {}
    dtypes = (torch.float32, torch.bfloat16) if dev.type == "cuda" else (torch.float32,)
    for name in ("llama-gqa", "qwen3"):
        for dtype in dtypes:
            for forest_name, make in (("grpo", lambda: grpo_group(group=6)), ("deep", deep_tree)):
                model = make_model(name, dtype=dtype).to(dev)
                seqs, sf = make()
                g = torch.Generator().manual_seed(3)
                coefs = [torch.randn(len(s) - f, generator=g).to(dev) for s, f in zip(seqs, sf, strict=True)]
                model.zero_grad(set_to_none=True)
                lps, _ = dense_logprobs(model, seqs, sf)
                sum((lp * c).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
                g_ref = [p.grad.detach().clone() for p in model.parameters()]
                forest = PrefixForest.build(seqs, sf)
                for mode, block in (("keep", None), ("replay", 3), ("packed", None)):
                    model.zero_grad(set_to_none=True)
                    ex = TreeExecutor(model, mode=mode, block_size=block)
                    res = ex.backward(forest, [c.float() for c in coefs])
                    got = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
                    out[f"{name}/{dtype}/{forest_name}/{mode}"] = {
                        "logprob_err": _rel(res.logprobs, [lp.detach() for lp in lps]),
                        "grad_err": _rel(got, g_ref),
                    }
    _exact_moe_and_state(dev, dtypes, out)
    worst = {"packed_backend": _packed_backend(dev)}
    for key, r in out.items():
        dtype = key.split("/")[1]
        worst[dtype] = max(worst.get(dtype, 0.0), r["grad_err"])
    backend = worst.pop("packed_backend")
    return {"worst_grad_err": worst, "packed_backend": backend, "cases": out}


def _exact_moe_and_state(dev, dtypes, out: dict) -> None:
    """The MoE router loss (Qwen3-MoE, its sums on the device) and a Mamba-2 + attention layer
    (Falcon-H1, transformers' torch scan on the device) against the plain computation."""
    import torch

    from forkrl.core import PrefixForest, TreeExecutor
    from forkrl.core.executor import RouterLoss
    from forkrl.core.testing.models import dense_logprobs
    from forkrl.core.testing.models import tiny_causal_lm as make_model
    from forkrl.core.testing.router import router_window, stock_router_losses

    for name, modes in (("qwen3moe", ("keep", "replay", "packed")), ("falconh1", ("keep", "replay"))):
        for dtype in dtypes:
            model = make_model(name, dtype=dtype).to(dev)
            seqs, sf, rows = router_window()
            weights = [0.3, 0.7, 0.5]
            g = torch.Generator().manual_seed(3)
            coefs = [torch.randn(len(s) - f, generator=g).to(dev) for s, f in zip(seqs, sf, strict=True)]
            model.zero_grad(set_to_none=True)
            if name == "qwen3moe":
                values = stock_router_losses(model, seqs, sf, rows, weights, coefs)
            else:
                lps, _ = dense_logprobs(model, seqs, sf)
                sum((lp * c).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
            g_ref = [p.grad.detach().clone() for p in model.parameters()]
            forest = PrefixForest.build(seqs, sf)
            for mode in modes:
                model.zero_grad(set_to_none=True)
                router = RouterLoss(weights).bind(forest, rows) if name == "qwen3moe" else None
                ex = TreeExecutor(model, mode=mode, block_size=3 if mode == "replay" else None)
                ex.backward(forest, [c.float() for c in coefs], router=router)
                got = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
                case = {"grad_err": _rel(got, g_ref)}
                if router is not None:
                    case["aux_err"] = float((router.values().cpu() - values.cpu().double()).abs().max())
                out[f"{name}/{dtype}/window/{mode}"] = case


def _packed_backend(dev) -> str:
    from forkrl.core.executor import packed

    if not packed._use_flex(dev):
        return "dense mask" + (
            " (FlexAttention failed: see the log)" if str(dev) in packed._FLEX_FAILED else ""
        )
    return "FlexAttention BlockMask"


def _half_b(tiny: bool):
    """A 0.5B-shaped Llama (Qwen2.5-0.5B's widths), or a small one for the smoke test."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        fields = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
        )
    else:
        fields = dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
        )
    cfg = LlamaConfig(max_position_embeddings=1 << 21, **fields)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def stage_long_context(ctx) -> dict:
    import torch

    from benchmarks.tree_training import grpo_batch
    from forkrl.core import PrefixForest, TreeExecutor

    dev, tiny = ctx.device, ctx.tiny
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = _half_b(tiny).to(dev, dtype)
    R, block = (16, 64) if tiny else (512, 4096)
    P0 = 256 if tiny else 32768
    out: dict = {"R": R, "block": block, "dtype": str(dtype)}

    def run(P: int, G: int) -> dict:
        seqs, sf, coefs = grpo_batch(P, G, R, model.config.vocab_size)
        forest = PrefixForest.build(seqs, sf)
        ex = TreeExecutor(model, mode="replay", block_size=block, prompt_grad="exact")
        model.zero_grad(set_to_none=True)
        free(dev)
        r: dict = {"P": P, "G": G}
        with _peak(dev, r, "peak_mb"):
            r["seconds"], _ = _timed(dev, lambda: ex.backward(forest, coefs))
        return r

    out["g2"] = run(P0, 2)
    ctx.partial(out)
    out["g8"] = run(P0, 8)
    if "peak_mb" in out["g2"]:
        out["g8_over_g2_memory"] = out["g8"]["peak_mb"] / out["g2"]["peak_mb"]
    ctx.partial(out)
    P, fits = P0 * 2, []
    limit = P0 * 4 if tiny else 1 << 21
    while P <= limit and ctx.left() > 30:
        try:
            fits.append(run(P, 2))
        except torch.OutOfMemoryError:
            out["first_oom_P"] = P
            break
        out["fits"] = fits
        ctx.partial(out)
        # The next doubling must fit in the time left (attention grows with P squared).
        if fits[-1]["seconds"] * 4.5 > ctx.left():
            break
        P *= 2
    out["longest_P"] = fits[-1]["P"] if fits else P0
    return out


def stage_drafter(ctx) -> dict:
    import torch

    from forkrl.core.quant import linear as qlinear
    from forkrl.core.speculative import Drafter, SpeculationPolicy, SpeculativeSampler

    dev, tiny = ctx.device, ctx.tiny
    out: dict = {"kernels": {}}
    for bits in (4, 8):
        out["kernels"][f"int{bits}"] = qlinear._pick_kernel(bits, dev, 128)
    # Matmul time, one layer of 4096 x 4096 (bf16 dense vs the drafter's kernel), batch 1-64.
    k = 256 if tiny else 4096
    layer = torch.nn.Linear(k, k, bias=False).to(dev, torch.bfloat16)
    table = {}
    for bits in (4, 8):
        q = qlinear.QuantLinear(k, k, bits=bits, device=dev)
        q.load_(layer.weight)
        table[f"int{bits}/kernel"] = q.kernel
        for b in (1, 4, 16, 64):
            x = torch.randn(b, k, device=dev, dtype=torch.bfloat16)
            reps = 5 if tiny else 50
            t_q, _ = _timed(dev, lambda q=q, x=x, reps=reps: [q(x) for _ in range(reps)])
            t_d, _ = _timed(dev, lambda x=x, reps=reps: [layer(x) for _ in range(reps)])
            table[f"int{bits}/b{b}"] = {"quant_us": 1e6 * t_q / reps, "bf16_us": 1e6 * t_d / reps}
    out["matmul"] = table
    ctx.partial(out)
    # Exact greedy equality and a rollout on a model large enough to be weight-bandwidth-bound.
    model = _half_b(tiny).to(dev, torch.bfloat16).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (4, 32), generator=g).to(dev)
    new = 16 if tiny else 128
    drafter = Drafter.from_policy(model, bits=4, group_size=32 if tiny else 128)
    out["drafter_kernel"] = drafter.kernel
    plain = SpeculativeSampler(model, None, SpeculationPolicy.never())
    spec = SpeculativeSampler(model, drafter, SpeculationPolicy.fixed(4))
    t_plain, a = _timed(dev, lambda: plain.generate(prompts, max_new_tokens=new, temperature=0.0))
    t_spec, b = _timed(dev, lambda: spec.generate(prompts, max_new_tokens=new, temperature=0.0))
    t_hf, ref = _timed(
        dev, lambda: model.generate(prompts, max_new_tokens=new, do_sample=False, min_new_tokens=new)
    )
    out["greedy"] = {
        "plain_equals_generate": bool(torch.equal(a.sequences[:, : ref.shape[1]], ref)),
        "speculative_equals_plain": bool(torch.equal(a.sequences, b.sequences)),
        "first_difference": _first_difference(a.sequences, b.sequences, prompts.shape[1]),
        "plain_s": t_plain,
        "speculative_s": t_spec,
        "hf_generate_s": t_hf,
        "acceptance": b.stats.as_metrics().get("spec/acceptance"),
    }
    ctx.partial(out)
    # bf16 verification scores k+1 tokens in one pass and plain decoding one at a time: a random
    # model's near-tied logits can flip an argmax by rounding alone. In float32 (TF32 off) greedy
    # equality is the sampler's contract, not rounding's.
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model = model.float()
        drafter = Drafter.from_policy(model, bits=4, group_size=32 if tiny else 128)
        plain = SpeculativeSampler(model, None, SpeculationPolicy.never())
        spec = SpeculativeSampler(model, drafter, SpeculationPolicy.fixed(4))
        n32 = min(new, 32)
        a = plain.generate(prompts, max_new_tokens=n32, temperature=0.0)
        b = spec.generate(prompts, max_new_tokens=n32, temperature=0.0)
        out["greedy_float32"] = {
            "speculative_equals_plain": bool(torch.equal(a.sequences, b.sequences)),
            "first_difference": _first_difference(a.sequences, b.sequences, prompts.shape[1]),
            "acceptance": b.stats.as_metrics().get("spec/acceptance"),
        }
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def _first_difference(a, b, start: int) -> int | None:
    """The first generated position (from 0) where two ``[B, L]`` token batches differ, or None."""
    n = min(a.shape[1], b.shape[1])
    diff = (a[:, start:n] != b[:, start:n]).any(0).nonzero()
    return int(diff[0]) if len(diff) else None


def stage_precision(ctx) -> dict:
    """Tree passes under the host's autocast (bf16; fp16 on CUDA) over float32 parameters: mixed
    float32/half inputs reach the split attention's kernels (CUDA flash under autocast) and the
    FlexAttention tree mask. Per case, ``|tree - fp32|`` and ``|tree - stock|`` over
    ``|stock - fp32|`` on the log-probs and the gradient (tests/core/test_precision.py's criterion:
    0.5 .. 1.5 and < 1.5)."""
    import torch

    from forkrl.core import PrefixForest, TreeExecutor
    from forkrl.core.testing import Bf16Rounding
    from forkrl.core.testing.forests import deep_tree, grpo_group
    from forkrl.core.testing.models import dense_logprobs
    from forkrl.core.testing.models import tiny_causal_lm as make_model

    dev = ctx.device
    a, fa = grpo_group(seed=3, group=6)
    b, fb = deep_tree()
    seqs, sf = a + b, fa + fb
    g = torch.Generator().manual_seed(7)
    coefs = [torch.randn(len(s) - f, generator=g).to(dev) for s, f in zip(seqs, sf, strict=True)]
    flat = lambda xs: torch.cat([x.detach().double().flatten().cpu() for x in xs])  # noqa: E731

    def stock(model):
        model.zero_grad(set_to_none=True)
        lps, _ = dense_logprobs(model, seqs, sf)
        sum((lp.float() * c).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
        return flat(lps), flat([p.grad for p in model.parameters()])

    def tree(model, mode):
        model.zero_grad(set_to_none=True)
        forest = PrefixForest.build(seqs, sf)
        ex = TreeExecutor(model, mode=mode, block_size=3 if mode == "replay" else None)
        scored = ex.score(forest)
        ex.backward(forest, coefs)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        return flat(scored.logprobs), flat(grads)

    half = (torch.bfloat16, torch.float16) if dev.type == "cuda" else (torch.bfloat16,)
    out, worst = {}, {"off_max": 0.0, "off_min": float("inf"), "near_max": 0.0}
    for name in ("llama-gqa", "qwen3"):
        model = make_model(name, dtype=torch.float32).to(dev)
        exact = stock(model)
        for dtype in half:
            with torch.autocast(dev.type, dtype=dtype):
                ref = stock(model)
                for mode in ("keep", "replay", "packed"):
                    got = tree(model, mode)
                    case = {}
                    for i, what in enumerate(("logprobs", "grad")):
                        rounding = Bf16Rounding(f"{name} {dtype} {mode} {what}", got[i], ref[i], exact[i])
                        off, near = rounding.off, rounding.near
                        case[what] = {"off": off, "near": near}
                        worst["off_max"], worst["off_min"] = (
                            max(worst["off_max"], off),
                            min(worst["off_min"], off),
                        )
                        worst["near_max"] = max(worst["near_max"], near)
                    out[f"{name}/{dtype}/{mode}"] = case
            ctx.partial({"cases": out})
    ok = worst["off_min"] >= 0.5 and worst["off_max"] <= 1.5 and worst["near_max"] < 1.5
    return {"criterion_met": ok, "worst": worst, "packed_backend": _packed_backend(dev), "cases": out}
