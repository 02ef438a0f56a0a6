"""Self-speculative rollout against plain sampling, on a trained model and a long-tailed workload.

1. Trains a Llama (a forkrl.core.testing.models.SIZES size; intermediate rounded up to a multiple
   of 128 so int4 groups of 128 tile it, which SIZES' 344/1376 do not) for --train-seconds on a noisy
   countdown grammar: prompt ``[BOS, filler..., SEP, v0]``, then ``v-1`` (p=0.85) or ``v-2``
   (p=0.15) down to 0/1, then EOS, so a completion is about v0 / 1.15 tokens long and its
   length is set by the prompt. Sampling stays stochastic (temperature 1), acceptance realistic.
2. Builds the int4 drafter (Drafter.from_policy) and calibrates a SpeculationPolicy on this
   machine (timings of both models over active batch sizes).
3. Rolls out, side by side in one process, each workload with
     hf        transformers generate (do_sample, top_k=0: the same distribution)
     plain     SpeculativeSampler with SpeculationPolicy.never(): the same cache/batching code,
               no drafter
     auto      SpeculativeSampler with the calibrated policy
     always    SpeculativeSampler with SpeculationPolicy.fixed(--always-k)
   Workloads: ``longtail`` (--batch prompts, 85% short completions of 5-35 tokens, 15% long of
   170-310), ``short`` (--batch prompts, all short, budget --short-max-new-tokens), ``few-long``
   (4 prompts, all long) and ``one-long`` (1 prompt, long).
   Ratios are wall time over the faster plain sampler (hf or plain) in the same run; --repeats
   runs per method (median), methods interleaved.

Prints the calibration table, the rollout table, then one line of JSON.

    .venv/bin/python -m benchmarks.speculative_rollout                                # ~8 min on 2 CPU cores
    .venv/bin/python -m benchmarks.speculative_rollout --model tiny --train-seconds 60  # quick look
    .venv/bin/python -m benchmarks.speculative_rollout --device cuda --batch 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.common import machine, print_table, timed
from forkrl.core.speculative import Drafter, SpeculationPolicy, SpeculativeSampler
from forkrl.core.testing import peak_rss_bytes
from forkrl.core.testing.models import SIZES, llama

# SIZES' "micro" is prefix_grouper_compare's smoke-test size; the choices here stay tiny and small.
MODEL_CHOICES = sorted(name for name in SIZES if name != "micro")

PAD, BOS, EOS, SEP = 0, 1, 2, 3
FILLER = (4, 100)  # filler token ids in the prompt
VALUE0 = 100  # value v is token VALUE0 + v
MAX_V = 400
SHORT_V, LONG_V = (6, 40), (200, 360)


def make_model(name: str, device: str, vocab: int | None = None) -> torch.nn.Module:
    """A SIZES-size Llama with the grammar's special tokens and an int4-tileable MLP width."""
    inter = SIZES[name][4]
    model = llama(
        name,
        max_pos=2048,
        vocab_size=vocab or SIZES[name][5],
        intermediate_size=-(-inter // 128) * 128,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return model.to(device)


def countdown(v0: int, g: torch.Generator) -> list[int]:
    """The completion for start value v0: noisy countdown, then EOS."""
    out, v = [], v0
    while v > 1:
        v -= 2 if float(torch.rand((), generator=g)) < 0.15 else 1
        out.append(VALUE0 + v)
    return out + [EOS]


def prompt(v0: int, g: torch.Generator) -> list[int]:
    n = int(torch.randint(0, 7, (), generator=g))
    return [BOS] + torch.randint(*FILLER, (n,), generator=g).tolist() + [SEP, VALUE0 + v0]


def draw_v0(kind: str, g: torch.Generator) -> int:
    lo, hi = SHORT_V if kind == "short" else LONG_V
    return int(torch.randint(lo, hi + 1, (), generator=g))


def workload(kind: str, batch: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    if kind == "longtail":
        return [
            draw_v0("long" if float(torch.rand((), generator=g)) < 0.15 else "short", g) for _ in range(batch)
        ]
    return [draw_v0(kind, g) for _ in range(batch)]


def left_pad(seqs: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def train(
    model, seconds: float, batch: int, window: int, device: str, seed: int, lr: float = 3e-3
) -> list[float]:
    """Next-token training on countdown windows; random position offsets cover long rollouts."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses, t0 = [], time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        for group in opt.param_groups:  # linear decay to 10% over the time budget
            group["lr"] = lr * max(0.1, 1 - elapsed / seconds)
        rows, labels, offsets = [], [], []
        for _ in range(batch):
            v0 = int(torch.randint(2, MAX_V, (), generator=g))
            p = prompt(v0, g)
            c = countdown(v0, g)
            # A window of the sequence: the prompt and the first part of the completion (40%), the
            # end of the completion with its EOS (30%), or a middle part (30%), at its true positions.
            u = float(torch.rand((), generator=g))
            if u < 0.4 or len(c) <= window:
                start = 0
            elif u < 0.7:
                start = len(c) - window + 1
            else:
                start = int(torch.randint(1, len(c) - window + 1, (), generator=g))
            seq = (p + c)[:window] if start == 0 else c[start - 1 : start - 1 + window]
            off = 0 if start == 0 else len(p) + start - 1
            rows.append(seq)
            offsets.append(off)
            labels.append(len(p) if start == 0 else 1)  # first position whose next token is scored
        width = max(map(len, rows))
        ids = torch.full((batch, width), PAD, dtype=torch.long)
        lab = torch.full((batch, width), -100, dtype=torch.long)
        pos = torch.zeros(batch, width, dtype=torch.long)
        for i, (s, first, off) in enumerate(zip(rows, labels, offsets, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            lab[i, first : len(s)] = torch.tensor(s[first:])
            pos[i] = torch.arange(width) + off
        ids, lab, pos = ids.to(device), lab.to(device), pos.to(device)
        loss = model(input_ids=ids, position_ids=pos, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def entropy_floor() -> float:
    """Per-token cross-entropy of the grammar itself (nats), on the scored completion tokens."""
    h = -(0.85 * torch.log(torch.tensor(0.85)) + 0.15 * torch.log(torch.tensor(0.15)))
    return float(h) * 0.97  # the EOS and v<=2 steps are deterministic: ~3% of tokens


def kernel_table(model, drafter, rows=(1, 4, 16, 64), repeats: int = 20) -> list[dict]:
    """Summed time of every linear layer at M input rows (ms): the policy's dense float32 layers,
    the drafter's int4 layers (bfloat16 activations, as they run), and the same int4 op fed float32
    activations (its slow scalar path: why the drafter computes in bfloat16)."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    quant = [drafter.quantized[n] for n, _ in layers]

    def clock(calls) -> float:
        with torch.no_grad():
            for c in calls:
                c()
            t0 = time.perf_counter()
            for _ in range(repeats):
                for c in calls:
                    c()
        return 1e3 * (time.perf_counter() - t0) / repeats

    out = []
    for m_rows in rows:
        dense = [(m, torch.randn(m_rows, m.in_features)) for _, m in layers]
        q16 = [(q, torch.randn(m_rows, q.in_features, dtype=torch.bfloat16)) for q in quant]
        q32 = [(q, torch.randn(m_rows, q.in_features), q.scales_and_zeros.float()) for q in quant]
        row = {
            "rows": m_rows,
            "dense_fp32_ms": clock([lambda m=m, x=x: m(x) for m, x in dense]),
            "int4_bf16_ms": clock([lambda q=q, x=x: q(x) for q, x in q16]),
            "int4_fp32_ms": clock(
                [
                    lambda q=q, x=x, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(
                        x, q.packed, q.group_size, sz
                    )
                    for q, x, sz in q32
                ]
            ),
        }
        row["int4_over_dense"] = row["int4_bf16_ms"] / row["dense_fp32_ms"]
        out.append(row)
    return out


def length_stats(lengths: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(lengths.double(), torch.tensor([0.5, 0.9], dtype=torch.float64)).tolist()
    return {"len_p50": q[0], "len_p90": q[1], "len_max": float(lengths.max())}


def clocked(fn) -> tuple[float, float, object]:
    """(wall seconds, this process's CPU seconds, result) of ``fn()``."""
    c0 = time.process_time()
    wall, out = timed(fn)
    return wall, time.process_time() - c0, out


def run_method(method, model, drafter, policy, ids, mask, max_new, args, seed) -> dict:
    g = torch.Generator(device=args.device).manual_seed(seed)
    if method == "hf":
        torch.manual_seed(seed)
        wall, cpu, out = clocked(
            lambda: model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=args.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new,
                eos_token_id=EOS,
                pad_token_id=PAD,
            )
        )
        comp = out[:, ids.shape[1] :]
        ended = (comp == EOS).cumsum(-1)
        lengths = ((ended == 0) | ((ended == 1) & (comp == EOS))).sum(-1)
        return {"wall_s": wall, "cpu_s": cpu, "tokens": int(lengths.sum()), **length_stats(lengths)}
    sampler = SpeculativeSampler(model, drafter if method != "plain" else None, policy)
    wall, cpu, out = clocked(
        lambda: sampler.generate(
            ids,
            mask,
            max_new_tokens=max_new,
            temperature=args.temperature,
            eos_token_id=EOS,
            pad_token_id=PAD,
            generator=g,
        )
    )
    s = out.stats
    lengths = out.completion_lengths
    hist = [k for k in s.draft_length_history if k]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens": s.generated_tokens,
        "acceptance": s.acceptance_rate,
        "spec_frac": s.speculated_fraction,
        "mean_k": sum(hist) / len(hist) if hist else 0.0,
        "tok_per_step": s.mean_accepted_length,
        "target_calls": s.target_calls,
        "drafter_calls": s.drafter_calls,
        **length_stats(lengths),
        "first_spec_batch": next(
            (b for k, b in zip(s.draft_length_history, s.batch_size_history, strict=True) if k), 0
        ),
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=MODEL_CHOICES)
    ap.add_argument(
        "--vocab",
        type=int,
        default=4096,
        help="vocabulary size (SIZES' 32000 makes the LM head 40%% of the small model's FLOPs, against "
        "about 7%% in a 7B model; 4096 restores a realistic share and trains 4x faster)",
    )
    ap.add_argument("--train-seconds", type=float, default=180)
    ap.add_argument("--train-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--window", type=int, default=48)
    ap.add_argument("--batch", type=int, default=64, help="prompts in the longtail and short workloads")
    ap.add_argument("--workloads", default="longtail,short,few-long,one-long")
    ap.add_argument(
        "--methods",
        default=None,
        help="default hf,plain,auto,always; with --engine vllm plain,auto,always,ngram",
    )
    ap.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="vllm: the policy served by vLLM engines (benchmarks.speculative_rollout_vllm), in an environment "
        "with vLLM",
    )
    ap.add_argument(
        "--vllm-dir", default="/tmp/forkrl-speculative-rollout", help="where vLLM reads the policy"
    )
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--short-max-new-tokens", type=int, default=48, help="budget of the short workload")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--always-k", type=int, default=4)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--calib-batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--calib-context", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default=None,
        help="what ratios and calibration measure; default cpu (process CPU time) with --threads 1, which "
        "ignores other processes on a shared machine, else wall",
    )
    ap.add_argument("--save-model", default="", help="save the trained weights here")
    ap.add_argument("--load-model", default="", help="skip training: load weights saved with --save-model")
    return ap.parse_args()


def trained_model(args) -> tuple[torch.nn.Module, int, list[float], list[float]]:
    """The policy, trained for --train-seconds (or loaded with --load-model): (model, parameter
    count, training losses, the last tenth of them)."""
    model = make_model(args.model, args.device, args.vocab)
    n_params = sum(p.numel() for p in model.parameters())
    if args.load_model:
        model.load_state_dict(torch.load(args.load_model, map_location=args.device))
        model.eval()
        losses = [float("nan")]
        print(f"# loaded {args.model} ({n_params / 1e6:.1f}M parameters) from {args.load_model}")
    else:
        print(
            f"# training {args.model} ({n_params / 1e6:.1f}M parameters) for {args.train_seconds:.0f} s",
            flush=True,
        )
        losses = train(
            model, args.train_seconds, args.train_batch, args.window, args.device, args.seed, args.lr
        )
    if args.save_model:
        torch.save(model.state_dict(), args.save_model)
    tail = losses[-max(1, len(losses) // 10) :]
    if not args.load_model:
        print(
            f"# {len(losses)} steps, loss {losses[0]:.3f} -> {sum(tail) / len(tail):.3f} "
            f"(grammar floor ~{entropy_floor():.3f})"
        )
    return model, n_params, losses, tail


def build_drafter(model, args) -> tuple[Drafter, dict, float, float]:
    """The int4 drafter, its memory report, build and refresh seconds; prints a summary."""
    t_build, drafter = timed(lambda: Drafter.from_policy(model, bits=args.bits, group_size=args.group_size))
    t_refresh, _ = timed(lambda: drafter.refresh(model))
    mem = drafter.memory_report(model)
    print(
        f"# drafter {drafter.kernel} ({drafter.kernels}), {mem['drafter_bytes'] / 2**20:.1f} MiB = "
        f"{100 * mem['overhead_fraction']:.1f}% of the policy; build {t_build:.2f} s, refresh {t_refresh:.2f} s"
    )
    return drafter, mem, t_build, t_refresh


def linear_layers(model, drafter, args) -> list[dict]:
    """The linear-layer kernel table (CPU only; printed), else []."""
    if args.device != "cpu":
        return []  # the CUDA int4 op has a different layout; the calibration table covers it
    kernels = kernel_table(model, drafter)
    print("\n## Linear layers, summed over the model (ms per forward at M rows)\n")
    print_table(
        kernels,
        [("rows", "{}"), ("dense_fp32_ms", "{:.2f}"), ("int4_bf16_ms", "{:.2f}"), ("int4_over_dense", "{:.3f}"),
         ("int4_fp32_ms", "{:.2f}")],
    )  # fmt: skip
    return kernels


def calibrated_policy(model, drafter, clock: str, args) -> tuple[SpeculationPolicy, float, list[dict]]:
    """The policy calibrated on this machine, its acceptance estimate warmed on the task; prints the
    calibration table. Returns (policy, its starting acceptance estimate alpha0, calibration rows)."""
    calib_batches = [int(b) for b in args.calib_batches.split(",")]
    t_cal, policy = timed(
        lambda: SpeculationPolicy.calibrate(
            model, drafter, batch_sizes=calib_batches, context_len=args.calib_context, margin=args.margin,
            temperature=args.temperature, clock=time.process_time if clock == "cpu" else time.perf_counter,
        )
    )  # fmt: skip

    # Warm the acceptance estimate (not timed), as a policy carries it across RL steps: a few short
    # and long prompts of the task, always speculating.
    wg = torch.Generator().manual_seed(99)
    warm_ids, warm_mask = left_pad(
        [prompt(v, wg) for v in workload("short", 4, 98) + workload("long", 4, 99)], args.device
    )
    probe = SpeculationPolicy.fixed(args.always_k)
    SpeculativeSampler(model, drafter, probe).generate(
        warm_ids,
        warm_mask,
        max_new_tokens=128,
        eos_token_id=EOS,
        generator=torch.Generator(args.device).manual_seed(2),
    )
    policy.alpha = probe.alpha
    alpha0 = policy.alpha
    calib = policy.cost_model.table(alpha0, policy.ladder)
    print(
        f"\n## Calibration ({t_cal:.1f} s, {clock} clock, context {args.calib_context}, alpha {alpha0:.3f})\n"
    )
    print_table(
        calib,
        [("batch", "{}"), ("target_ms", "{:.2f}"), ("draft_ms", "{:.2f}"), ("verify_ms", "{:.2f}"),
         ("draft_over_target", "{:.3f}"), ("verify_over_target", "{:.3f}"), ("best_k", "{}"), ("speedup", "{:.3f}")],
    )  # fmt: skip
    return policy, alpha0, calib


def workload_prompts(wl: str, args) -> tuple[list[list[int]], int]:
    """Workload ``wl``'s prompts and token budget."""
    bsz = {"few-long": 4, "one-long": 1}.get(wl, args.batch)
    max_new = args.short_max_new_tokens if wl == "short" else args.max_new_tokens
    v0s = workload("long" if wl.endswith("-long") else wl, bsz, args.seed + 1)
    g = torch.Generator().manual_seed(args.seed + 2)
    return [prompt(v, g) for v in v0s], max_new


def run_workload(wl, model, drafter, policy, alpha0, methods, args) -> tuple[dict[str, list[dict]], int, int]:
    """Every method's --repeats runs on workload ``wl``, interleaved: (runs per method, batch, budget)."""
    prompts, max_new = workload_prompts(wl, args)
    bsz = len(prompts)
    ids, mask = left_pad(prompts, args.device)
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for r in range(args.repeats):
        for m in methods if r % 2 == 0 else methods[::-1]:
            if m == "hf" and r:  # several times slower than plain: one run is enough to show it
                continue
            pol = {"plain": SpeculationPolicy.never(), "auto": policy,
                   "always": SpeculationPolicy.fixed(args.always_k), "hf": None}[m]  # fmt: skip
            if m == "auto":
                policy.alpha = alpha0  # each repeat starts from the same estimate
            res = run_method(m, model, drafter, pol, ids, mask, max_new, args, seed=args.seed + 10 * r)
            runs[m].append(res)
            print(f"# {wl} {m} repeat {r}: wall {res['wall_s']:.2f} s, cpu {res['cpu_s']:.2f} s", flush=True)
    return runs, bsz, max_new


def workload_rows(wl, runs: dict[str, list[dict]], bsz: int, max_new: int, methods, key: str) -> list[dict]:
    """One row per method: medians over the repeats, and times paired against the plain runs."""
    rows = {}
    for m, rs in runs.items():
        row = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        row.update(workload=wl, method=m, batch=bsz, max_new=max_new, tok_per_s=row["tokens"] / row[key])
        rows[m] = row
    # Ratios are paired: each run against the plain run of the same repeat (adjacent in time),
    # then the median over repeats, which cancels slow drifts in the machine's load.
    base = "plain" if "plain" in runs else methods[0]
    out = []
    for m, row in rows.items():
        pairs = list(zip(runs[m], runs[base], strict=False))
        row["time_vs_plain"] = statistics.median(x[key] / y[key] for x, y in pairs)
        row["per_token_vs_plain"] = statistics.median(
            (x[key] / x["tokens"]) / (y[key] / y["tokens"]) for x, y in pairs
        )
        out.append(row)
    return out


def print_results(results: list[dict], clock: str) -> None:
    print(
        f"\n## Rollout (median of repeats; {clock} clock; time_vs_plain: median over repeats of time / plain's time"
        " in the same repeat)\n"
    )
    print_table(
        results,
        [("workload", "{}"), ("batch", "{}"), ("method", "{}"), ("wall_s", "{:.2f}"), ("cpu_s", "{:.2f}"),
         ("time_vs_plain", "{:.3f}"), ("time_vs_plain_dense", "{:.3f}"), ("per_token_vs_plain", "{:.3f}"), ("tokens", "{:.0f}"),
         ("len_p50", "{:.0f}"), ("len_p90", "{:.0f}"), ("len_max", "{:.0f}"), ("acceptance", "{:.3f}"),
         ("spec_frac", "{:.2f}"), ("mean_k", "{:.2f}"), ("tok_per_step", "{:.2f}"), ("first_spec_batch", "{:.0f}"),
         ("tok_per_s", "{:.0f}"), ("draft_len", "{:.2f}"), ("mean_accepted_length", "{:.2f}")],
    )  # fmt: skip
    schedules = {r["method"]: r["schedule"] for r in results if r.get("schedule") is not None}
    for (
        method,
        schedule,
    ) in schedules.items():  # vLLM engines: the draft length per batch size they started with
        print(f"\n{method}: draft length per batch size (first, last, k): {schedule}")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, n_params, losses, tail = trained_model(args)
    drafter, mem, t_build, t_refresh = build_drafter(model, args)
    kernels = linear_layers(model, drafter, args)
    clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    policy, alpha0, calib = calibrated_policy(model, drafter, clock, args)

    t_decide, _ = timed(lambda: [policy.decide(b % 64 + 1, 8, 2 + b % 3, 300) for b in range(10000)])
    policy.alpha = alpha0
    print(f"# policy.decide: {1e6 * t_decide / 10000:.1f} us per decode step")

    if args.engine == "vllm":
        from benchmarks import speculative_rollout_vllm

        args.methods = args.methods or ",".join(speculative_rollout_vllm.METHODS)
        policy.alpha = alpha0
        workloads = {wl: workload_prompts(wl, args) for wl in args.workloads.split(",")}
        results = speculative_rollout_vllm.run(model, policy, workloads, args)
        clock = "wall"
    else:
        methods = (args.methods or "hf,plain,auto,always").split(",")
        key = "cpu_s" if clock == "cpu" else "wall_s"
        results = []
        for wl in args.workloads.split(","):
            runs, bsz, max_new = run_workload(wl, model, drafter, policy, alpha0, methods, args)
            results.extend(workload_rows(wl, runs, bsz, max_new, methods, key))

    print_results(results, clock)
    summary = {
        "benchmark": "speculative_rollout",
        "machine": machine(),
        "args": vars(args),
        "params_m": n_params / 1e6,
        "train_steps": 0 if args.load_model else len(losses),
        "train_loss_final": sum(tail) / len(tail),
        "drafter": {"kernel": drafter.kernel, **mem, "build_s": t_build, "refresh_s": t_refresh},
        "alpha": alpha0,
        "clock": clock,
        "decide_us": 1e6 * t_decide / 10000,
        "calibration": calib,
        "cost_model": {  # SpeculationPolicy.from_timings(**this) rebuilds the policy
            "batch_sizes": policy.cost_model.batch_sizes,
            "target_s": policy.cost_model.target_s,
            "draft_s": policy.cost_model.draft_s,
            "context_len": policy.cost_model.context_len,
        },
        "linear_layers": kernels,
        "results": results,
        "peak_rss_mb": peak_rss_bytes() / 2**20,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
