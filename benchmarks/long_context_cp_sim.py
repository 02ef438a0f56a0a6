"""Context-parallel long-context replay at scale, on paper, checked against CPU runs.

From a model config it predicts, per device count N (1, 8, 32 H200s of 141 GB), the longest prompt
whose *exact* gradient :class:`forkrl.core.executor.context_parallel.ContextParallelReplay` can
train, and the communication it needs. Per rank (bytes, ``b`` per element, ``N`` ranks):

    cache       (P / N) * L_attn * 2 * kv * d * b           the kept key/value shard
    cache grad  the same (exact gradient; 0 truncated)
    states      params * state_bytes / N                     weights, grads, Adam (ZeRO-3 over the group)
    activations max(block, response) * per-token activations of one unit with grad (all layers)
    queries     N * block * L_attn * H * d * b               every rank's queries of a round, saved for
                                                             its backward (the parallel schedule; the
                                                             serial one keeps one unit's: 1 * ...)
    reserve     fixed headroom (allocator, NCCL buffers, the LM head's logit chunks)

Communication per rank per step (every unit, per attention layer; queries travel, the cache stays):
forward ``n*H*d`` queries broadcast, ``n*H*(d+1)`` partials gathered at the owner; backward
``n*H*(2d+1)`` broadcast, ``n*H*d`` query gradient reduced: the prefill, the responses and the
replay (the serial schedule; the parallel one moves the same order of bytes, all-gathered and
all-to-all per round: :func:`parallel_comm_bytes`).

Time per step at the given MFU, two schedules (``ContextParallelReplay(schedule=...)``): ``serial``,
the owners compute their chunks in turn (the whole prompt's compute on one device's clock);
``parallel`` (the default), every rank its piece of each round at once, so the prompt's compute splits
``N`` ways, the responses' too (every rank its own, in ``ceil(G / N)`` rounds; each shard serves its
part of their attention), plus the parallel schedule's traffic at ``link_bandwidth`` (not overlapped).
Hybrid models run the serial schedule (their state passes chunk to chunk in position order), so their
``parallel`` column is their serial one.

The check runs the real thing on 2 and 4 gloo ranks (a tiny float32 Llama) and prints, per rank,
the measured kept shard and gradient-shard bytes and the measured collective payload next to this
model's prediction for the same config.

    .venv/bin/python -m benchmarks.long_context_cp_sim                  # table + CPU check, ~1 minute
    .venv/bin/python -m benchmarks.long_context_cp_sim --no-check       # the paper model only
    .venv/bin/python -m benchmarks.long_context_cp_sim --block 4096 --response 8192
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

from benchmarks.common import machine, print_table, run_ranks

GB = 1e9
H200_BYTES = 141 * GB
RANK_FLAG = "FORKRL_CP_SIM_RANK"


@dataclass
class Shape:
    """What the memory model needs of a decoder (bf16 unless ``b`` says otherwise)."""

    name: str
    params: float  # total parameters
    active: float  # parameters a token passes through (MoE: the active ones)
    layers: int
    attn_layers: int  # full-attention layers (the ones that keep a per-token cache)
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # per-token MLP width a token's activations hold (MoE: the active experts')
    vocab: int
    state_bytes_per_layer: float = 0.0  # recurrent/conv state of a linear-attention layer (per sequence)
    b: int = 2

    @property
    def cache_per_token(self) -> float:
        return self.attn_layers * 2 * self.kv_heads * self.head_dim * self.b

    @property
    def act_per_token(self) -> float:
        """Bytes autograd keeps per token of a unit run with grad: norms, q/k/v/o, the MLP's gate,
        up and activation, the residuals (a standard per-layer count, all layers)."""
        attn = self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim
        return self.layers * self.b * (8 * self.hidden + 2 * attn + 3 * self.intermediate)


MODELS = {
    # Qwen2.5-7B: 28 layers, GQA 28 query / 4 key-value heads of 128.
    "qwen2.5-7b": Shape("Qwen2.5-7B (dense, GQA)", 7.6e9, 7.6e9, 28, 28, 3584, 28, 4, 128, 18944, 152064),
    # Llama-2-7B: 32 layers, MHA (32 key/value heads).
    "llama-2-7b": Shape("Llama-2-7B (dense, MHA)", 6.7e9, 6.7e9, 32, 32, 4096, 32, 32, 128, 11008, 32000),
    # Qwen3-Next-80B-A3B: 48 layers, 1 in 4 full attention (16 q / 2 kv heads of 256), the rest Gated
    # DeltaNet (32 value heads x 128 x 128 fp32 state + conv); 512 experts, 10 routed + 1 shared of 512.
    "qwen3-next-80b": Shape(
        "Qwen3-Next-80B-A3B (hybrid MoE; serial schedule)",
        80e9,
        3e9,
        48,
        12,
        2048,
        16,
        2,
        256,
        11 * 512,
        151936,
        state_bytes_per_layer=32 * 128 * 128 * 4 + 4 * 8192 * 2,
    ),
}

LONGSTRAW = [
    {"system": "LongStraw (truncated gradient)", "devices": 8, "max_P": 2_100_000, "note": "reported"},
    {
        "system": "LongStraw (truncated, stress)",
        "devices": 8,
        "max_P": 4_460_000,
        "note": "reported, under stress",
    },
    {
        "system": "LongStraw (truncated)",
        "devices": 32,
        "max_P": 2_100_000,
        "note": "78-layer model validated",
    },
]


@dataclass
class Setup:
    block: int = 2048
    response: int = 2048
    group: int = 8
    state_bytes: float = 16.0  # per parameter: bf16 weights + grads, fp32 master + Adam m, v
    reserve: float = 10 * GB
    mfu: float = 0.4
    peak_flops: float = 989e12  # H200 dense bf16
    link_bandwidth: float = 400e9  # bytes/s a rank receives (NVLink within a node, conservative)


def per_rank_bytes(m: Shape, P: int, n: int, s: Setup, exact: bool = True) -> dict:
    """Predicted bytes per rank for a prompt of ``P`` tokens over ``n`` ranks."""
    tokens = -(-(P - 1) // n)
    cache = tokens * m.cache_per_token
    unit = max(s.block, s.response + 1)
    out = {
        "cache": cache,
        "cache_grad": cache if exact else 0.0,
        "states": m.params * s.state_bytes / n,
        "activations": unit * m.act_per_token,
        # the parallel schedule saves every rank's queries of a round; hybrids run the serial one
        "queries": (n if m.attn_layers == m.layers else 1)
        * s.block
        * m.attn_layers
        * m.heads
        * m.head_dim
        * m.b,
        "state": (m.layers - m.attn_layers) * m.state_bytes_per_layer * 2,  # a state and its gradient
        "reserve": s.reserve,
    }
    out["total"] = sum(out.values())
    return out


def comm_bytes(m: Shape, P: int, n: int, s: Setup, exact: bool = True, pack: int = 4) -> float:
    """Predicted bytes a serving rank sends or receives per step (all collectives, logical payload)."""
    if n == 1:
        return 0.0
    hd = m.heads * m.head_dim
    fwd = hd * m.b + m.heads * (m.head_dim + 1) * pack  # queries in, this rank's partial out
    bwd = m.heads * (2 * m.head_dim + 1) * pack + hd * m.b  # (dout, out, lse) in, dq out
    grad_tokens = s.group * (s.response + 1) + (P - 1 if exact else 0)
    fwd_tokens = (P - 1) + grad_tokens
    return m.attn_layers * (fwd_tokens * fwd + grad_tokens * bwd)


def parallel_comm_bytes(m: Shape, P: int, n: int, s: Setup, exact: bool = True, pack: int = 4) -> float:
    """Bytes a rank receives per step in the parallel schedule: per attention layer, every other
    rank's queries and partials for each prompt position (prefill, and with ``exact`` the replay's
    forward and backward: packs and query-gradient shares), plus the rounds of responses (every
    rank its own, padded to the round's longest)."""
    if n == 1:
        return 0.0
    hd = m.heads * m.head_dim
    fwd = hd * m.b + m.heads * (m.head_dim + 1) * pack
    bwd = m.heads * (2 * m.head_dim + 1) * pack + hd * m.b
    prompt = (P - 1) * (n - 1) / n * ((2 * fwd + bwd) if exact else fwd)
    responses = -(-s.group // n) * (n - 1) * (s.response + 1) * (fwd + bwd)
    return m.attn_layers * (prompt + responses)


def step_seconds(
    m: Shape, P: int, s: Setup, exact: bool = True, n: int = 1, schedule: str = "serial"
) -> float:
    """One step (prefill + responses + replay) at ``s.mfu`` on ``n`` devices (module docstring)."""
    hd = m.heads * m.head_dim
    dense = 2 * m.active
    fwd_prompt = dense * P + 2 * m.attn_layers * hd * P * P  # causal: half of 4 * P^2 * hd per layer
    tokens = s.group * (s.response + 1)
    resp_dense, resp_attn = tokens * dense, tokens * 4 * m.attn_layers * hd * P
    prompt = fwd_prompt + (3 * fwd_prompt if exact else 0)
    rate = s.peak_flops * s.mfu
    if schedule == "serial" or m.attn_layers < m.layers:  # hybrids: the serial schedule (docstring)
        return (prompt + 3 * (resp_dense + resp_attn)) / rate
    rounds = -(-s.group // n)  # rounds of responses, every rank its own
    compute = (prompt / n + 3 * (resp_dense * rounds / s.group + resp_attn / n)) / rate
    return compute + parallel_comm_bytes(m, P, n, s, exact) / s.link_bandwidth


def longest(m: Shape, n: int, s: Setup, exact: bool = True) -> int:
    """Longest prompt that fits a 141 GB device per rank (bisection on tokens)."""
    lo, hi = 0, 1 << 34
    if per_rank_bytes(m, n + 1, n, s, exact)["total"] > H200_BYTES:
        return 0
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if per_rank_bytes(m, mid, n, s, exact)["total"] <= H200_BYTES else (lo, mid)
    return lo


# ---------------------------------------------------------------------- the CPU check (rank side)
CHECK = dict(P=1537, block=128, G=4, R=16, layers=2, hidden=128, heads=4, kv_heads=2, vocab=512)


def _rank_main() -> None:
    import torch
    import torch.distributed as dist

    from forkrl.core.executor.context_parallel import ContextParallelReplay
    from forkrl.core.testing.models import tiny_causal_lm

    c = CHECK
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sent = {"bytes": 0}

    def counting(fn, role):
        def wrapped(tensor, *args, **kwargs):  # logical payload this rank sends or receives
            gather_list = args[0] if role == "gather" and args else kwargs.get("gather_list")
            if role == "gather" and gather_list:  # the owner receives the others' parts
                sent["bytes"] += tensor.numel() * tensor.element_size() * (len(gather_list) - 1)
            else:
                sent["bytes"] += tensor.numel() * tensor.element_size()
            return fn(tensor, *args, **kwargs)

        return wrapped

    model = tiny_causal_lm(
        "llama-gqa",
        dtype=torch.float32,
        num_hidden_layers=c["layers"],
        hidden_size=c["hidden"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"],
        vocab_size=c["vocab"],
        intermediate_size=2 * c["hidden"],
        max_position_embeddings=4096,
    )
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, c["vocab"], (c["P"],), generator=g)
    responses = [torch.randint(0, c["vocab"], (c["R"],), generator=g) for _ in range(c["G"])]
    coefs = [torch.randn(c["R"], generator=g) for _ in range(c["G"])]
    mine = list(range(rank, c["G"], world))
    originals = {name: getattr(dist, name) for name in ("broadcast", "gather", "reduce")}
    for name, fn in originals.items():
        setattr(dist, name, counting(fn, name))
    try:
        cp = ContextParallelReplay(model, block_size=c["block"], schedule="serial")
        res = cp.backward(prompt, [responses[i] for i in mine], [coefs[i] for i in mine])
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    record = {
        "rank": rank,
        "world": world,
        "shard": res.shard_bytes,
        "grad_shard": res.shard_grad_bytes,
        "comm": sent["bytes"],
        "chunk": sum(b - a for a, b in res.pieces),
    }
    print("RESULT " + json.dumps(record), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _check_rows() -> list[dict]:
    c = CHECK
    m = Shape(
        "check",
        0,
        0,
        c["layers"],
        c["layers"],
        c["hidden"],
        c["heads"],
        c["kv_heads"],
        c["hidden"] // c["heads"],
        2 * c["hidden"],
        c["vocab"],
        b=4,
    )
    s = Setup(block=c["block"], response=c["R"], group=c["G"], reserve=0)
    rows = []
    for n in (2, 4):
        for r in sorted(
            run_ranks("benchmarks.long_context_cp_sim", RANK_FLAG, ranks=n, timeout=600),
            key=lambda r: r["rank"],
        ):
            pred = per_rank_bytes(m, c["P"], n, s)
            # A rank's payload as a server of every unit, plus, for the units it owns, the other
            # ranks' partials it gathers (n - 2 more than a server's one).
            owned = 2 * r["chunk"] + len(range(r["rank"], c["G"], n)) * (c["R"] + 1)
            extra = owned * m.attn_layers * (n - 2) * m.heads * (m.head_dim + 1) * 4
            rows.append(
                {
                    "ranks": n,
                    "rank": r["rank"],
                    "chunk": r["chunk"],
                    "measured_cache_KB": (r["shard"] + r["grad_shard"]) / 1e3,
                    "predicted_cache_KB": (pred["cache"] + pred["cache_grad"]) / 1e3,
                    "measured_comm_MB": r["comm"] / 1e6,
                    "predicted_comm_MB": (comm_bytes(m, c["P"], n, s, pack=4) + extra) / 1e6,
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block", type=int, default=2048, help="prompt tokens forwarded at once")
    p.add_argument("--response", type=int, default=2048, help="tokens per response")
    p.add_argument("--group", type=int, default=8, help="responses per prompt (GRPO group)")
    p.add_argument(
        "--state-bytes", type=float, default=16.0, help="bytes per parameter of weights+grads+optimizer"
    )
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilisation for the time column")
    p.add_argument("--no-check", action="store_true", help="skip the 2- and 4-rank CPU check")
    args = p.parse_args()
    if os.environ.get(RANK_FLAG) == "1":
        _rank_main()
        return
    s = Setup(
        block=args.block, response=args.response, group=args.group, state_bytes=args.state_bytes, mfu=args.mfu
    )
    rows = []
    for key, m in MODELS.items():
        for n in (1, 8, 32):
            for exact in (True, False):
                P = longest(m, n, s, exact)
                mem = per_rank_bytes(m, max(P, 2), n, s, exact)
                rows.append(
                    {
                        "model": m.name,
                        "devices": n,
                        "gradient": "exact" if exact else "truncated",
                        "max_P": P,
                        "cache_KB_per_token": m.cache_per_token / 1e3,
                        "cache_GB": (mem["cache"] + mem["cache_grad"]) / GB,
                        "states_GB": mem["states"] / GB,
                        "act_GB": mem["activations"] / GB,
                        "comm_GB": comm_bytes(m, P, n, s, exact) / GB,
                        "hours_serial": step_seconds(m, P, s, exact) / 3600,
                        "hours_parallel": step_seconds(m, P, s, exact, n, "parallel") / 3600,
                        "key": key,
                    }
                )
    cols = [
        ("model", "{}"),
        ("devices", "{}"),
        ("gradient", "{}"),
        ("max_P", "{:,}"),
        ("cache_KB_per_token", "{:.1f}"),
        ("cache_GB", "{:.1f}"),
        ("states_GB", "{:.1f}"),
        ("act_GB", "{:.1f}"),
        ("comm_GB", "{:.0f}"),
        ("hours_serial", "{:.2f}"),
        ("hours_parallel", "{:.2f}"),
    ]
    print(
        f"H200 141 GB; block {s.block}, group {s.group} x {s.response} tokens, {s.state_bytes:g} B/param states "
        f"sharded over the devices, {s.reserve / GB:g} GB reserve; hours at MFU {s.mfu}: the serial schedule "
        f"(owners in turn) and the parallel one (plus its traffic at {s.link_bandwidth / GB:g} GB/s)"
    )
    print_table(rows, cols)
    print()
    print_table(LONGSTRAW, [("system", "{}"), ("devices", "{}"), ("max_P", "{:,}"), ("note", "{}")])
    q7 = next(r for r in rows if r["key"] == "qwen2.5-7b" and r["devices"] == 8 and r["gradient"] == "exact")
    m7 = MODELS["qwen2.5-7b"]
    at = {
        "model": m7.name,
        "devices": 8,
        "P": 2_100_000,
        "fits": q7["max_P"] >= 2_100_000,
        "hours_serial": step_seconds(m7, 2_100_000, s) / 3600,
        "hours_parallel": step_seconds(m7, 2_100_000, s, True, 8, "parallel") / 3600,
        "comm_GB_parallel": parallel_comm_bytes(m7, 2_100_000, 8, s) / GB,
    }
    print(
        f"\nQwen2.5-7B, 8 H200s, exact gradient: {q7['max_P']:,} positions fit (target 2,100,000: "
        f"{'met' if at['fits'] else 'NOT met'}); at LongStraw's 2,100,000: {at['hours_parallel']:.2f} h per step "
        f"in the parallel schedule ({at['hours_serial']:.2f} h serial; target under 1 h: "
        f"{'met' if at['fits'] and at['hours_parallel'] < 1 else 'NOT met'})"
    )
    check = []
    if not args.no_check:
        check = _check_rows()
        print(f"\nCPU check (tiny float32 Llama, {CHECK}):")
        print_table(check, [(k, "{:.1f}" if "KB" in k or "MB" in k else "{}") for k in check[0]])
    print(
        json.dumps(
            {
                "benchmark": "long_context_cp_sim",
                "machine": machine(),
                "setup": asdict(s),
                "rows": rows,
                "longstraw": LONGSTRAW,
                "at_2_1M": at,
                "check": check,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
