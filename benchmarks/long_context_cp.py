"""Context-parallel replay, measured: the parallel schedule against the serial one and one device.

One long prompt and its GRPO group on ``C`` gloo ranks (one thread each, as one device each), a tiny
float32 Llama: a step of :class:`~forkrl.core.executor.context_parallel.ContextParallelReplay` with
``schedule="serial"`` (owners in turn) and ``schedule="parallel"`` (every rank its piece of each
round at once), alternating, the median of ``--repeats``; beside them the same step on one rank alone
(a one-rank group: single-device replay's cost). Per rank: the kept cache shard and the bytes its
attention collectives receive, measured (the collectives wrapped) and predicted by
:func:`parallel_comm_bytes` / :func:`serial_comm_bytes`.

    .venv/bin/python -m benchmarks.long_context_cp                 # C = 2, about a minute
    .venv/bin/python -m benchmarks.long_context_cp --ranks 4 --prompt 2049
    .venv/bin/python -m benchmarks.long_context_cp --hybrid        # the state chain's cost

``--hybrid`` measures what a hybrid model's state chain costs (:mod:`forkrl.core.executor.cp_state`:
the conv/recurrent state passed chunk to chunk in position order, so hybrids run the serial
schedule): a tiny Qwen3-Next of the same width (linear attention and attention layers alternating)
on ``C`` ranks against one rank, the time each rank spends in the chain's collectives and the bytes
it sends, beside what the parallel schedule gives the attention-only Llama of the same size in the
same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks.common import machine, print_table, run_ranks

RANK_FLAG = "FORKRL_CP_RANK"
MODEL = dict(
    num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, vocab_size=512
)
HYBRID = dict(  # Qwen3-Next's linear attention (gated delta rule) and attention, alternating; 4 experts
    layer_types=["linear_attention", "full_attention"] * 2,
    head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="context-parallel group size C")
    p.add_argument("--prompt", type=int, default=4097, help="prompt tokens P")
    p.add_argument("--block", type=int, default=512, help="block_size (the parallel schedule's piece)")
    p.add_argument("--group", type=int, default=4, help="responses (GRPO group)")
    p.add_argument("--response", type=int, default=32, help="tokens per response")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per schedule (median)")
    p.add_argument("--hybrid", action="store_true", help="measure a hybrid model's state chain (docstring)")
    return p.parse_args(argv)


def _unit_bytes(n: int, owner: bool, grad: bool, world: int, heads: int, d: int, b: int, pb: int) -> int:
    """Bytes a rank receives per layer for one served unit of ``n`` tokens: as its owner, the other
    ranks' partials (and query-gradient shares); as a server, its queries (and its backward pack)."""
    rows = n * heads
    if owner:
        return (world - 1) * rows * ((d + 1) * pb + (d * b if grad else 0))
    return rows * (d * b + ((2 * d + 1) * pb if grad else 0))


def comm_bytes(
    schedule: str, cached: int, block: int, responses: list[list[int]], rank: int, shape: dict
) -> int:
    """Bytes rank ``rank`` receives in its attention collectives over one step (``shape``: world,
    layers, heads, d, b (compute dtype bytes), pb (pack dtype bytes); ``responses``: each rank's
    response lengths).

    Serial: every chunk is a served unit twice (prefill, replay with grad), on its owner, and every
    response a served unit of ``R + 1`` tokens. Parallel: per round and layer the other ranks' padded
    queries and partials (all-gather, all-to-all), in the replay also their ``(dout, out, lse)`` packs
    and query-gradient shares; the responses in rounds too (every rank its ``i``-th), padded to the
    round's longest.
    """
    from forkrl.core.executor.cp_rounds import chunk_bounds, rounds

    world, heads, d, b, pb = (shape[k] for k in ("world", "heads", "d", "b", "pb"))
    unit = lambda n, owner, grad: _unit_bytes(n, owner, grad, world, heads, d, b, pb)  # noqa: E731
    fwd = lambda longest: (world - 1) * longest * heads * (d * b + (d + 1) * pb)  # noqa: E731
    bwd = lambda longest: (world - 1) * longest * heads * ((2 * d + 1) * pb + d * b)  # noqa: E731
    total = 0
    if schedule == "serial":
        total += sum(unit(n + 1, o == rank, True) for o, lengths in enumerate(responses) for n in lengths)
        bounds = chunk_bounds(cached, world)
        for o in range(world):
            n = bounds[o + 1] - bounds[o]
            total += unit(n, o == rank, False) + unit(n, o == rank, True)
    else:
        for rd in rounds(cached, world, block):
            total += 2 * fwd(rd.longest) + bwd(rd.longest)  # prefill forward, replay forward and backward
        for i in range(max(map(len, responses))):  # rounds of responses: every rank its i-th (+ 1 token)
            longest = max(lengths[i] + 1 for lengths in responses if i < len(lengths))
            total += fwd(longest) + bwd(longest)
    return shape["layers"] * total


class _Received:
    """Counts the bytes this rank receives through ``torch.distributed``'s attention collectives
    while active (the gradient all-reduce and object gathers are left out: the same in both)."""

    NAMES = ("all_gather", "all_to_all", "broadcast", "gather", "reduce")

    def __enter__(self) -> _Received:
        import torch.distributed as dist

        self.bytes = 0
        self.originals = {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self.originals.items():
            setattr(dist, name, self._counted(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, fn in self.originals.items():
            setattr(dist, name, fn)

    def _counted(self, name: str, fn):
        import torch.distributed as dist

        def size(t) -> int:
            return t.numel() * t.element_size()

        def wrapped(*args, **kwargs):
            group = kwargs.get("group")
            me = dist.get_rank(group)
            if name in ("all_gather", "all_to_all"):
                self.bytes += sum(size(t) for i, t in enumerate(args[0]) if i != me)
            elif name == "broadcast":
                src = args[1] if len(args) > 1 else kwargs["src"]
                self.bytes += 0 if dist.get_global_rank(group, me) == src else size(args[0])
            else:  # gather / reduce: the owner receives the others' tensors
                dst = kwargs["dst"] if "dst" in kwargs else args[1 if name == "reduce" else 2]
                if dist.get_global_rank(group, me) == dst:
                    self.bytes += size(args[0]) * (dist.get_world_size(group) - 1)
            return fn(*args, **kwargs)

        return wrapped


class _Chain:
    """Times this rank's state-chain collectives (:class:`StateCarry` broadcasts and the final
    gradient's all-reduce) while active."""

    def __enter__(self) -> _Chain:
        import time

        from forkrl.core.executor.cp_state import StateCarry

        self.seconds, self.originals = 0.0, {}
        for name in ("broadcast", "sum_final_gradient"):
            fn = self.originals[name] = getattr(StateCarry, name)

            def timed(*args, _fn=fn, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0

            setattr(StateCarry, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        from forkrl.core.executor.cp_state import StateCarry

        for name, fn in self.originals.items():
            setattr(StateCarry, name, fn)


def _hybrid_rank_main(a: argparse.Namespace) -> None:
    import time

    import torch
    import torch.distributed as dist

    from forkrl.core.executor.context_parallel import ContextParallelReplay
    from forkrl.core.testing.models import tiny_causal_lm

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    common = dict(
        intermediate_size=2 * MODEL["hidden_size"], max_position_embeddings=a.prompt + a.response + 8
    )
    models = {
        "attn": tiny_causal_lm("llama-gqa", dtype=torch.float32, **common, **MODEL),
        "hybrid": tiny_causal_lm("qwen3next", dtype=torch.float32, **common, **MODEL, **HYBRID),
    }
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, MODEL["vocab_size"], (a.prompt,), generator=g)
    responses = [torch.randint(0, MODEL["vocab_size"], (a.response,), generator=g) for _ in range(a.group)]
    coefs = [torch.randn(a.response, generator=g) for _ in range(a.group)]
    mine = list(range(rank, a.group, world))
    group, alone_group = dist.new_group(list(range(world))), dist.new_group([0])

    def step(name: str, schedule: str, on=None) -> tuple[float, float, float, int]:
        """(wall seconds, compute seconds, seconds in the state chain, chain bytes sent) of one step."""
        model = models[name]
        model.zero_grad(set_to_none=True)
        cp = ContextParallelReplay(model, group=on or group, block_size=a.block, schedule=schedule)
        rs, cs = (responses, coefs) if on else ([responses[i] for i in mine], [coefs[i] for i in mine])
        with _Chain() as chain:
            t0, c0 = time.perf_counter(), time.thread_time()
            res = cp.backward(prompt, rs, cs)
            seconds, cpu = time.perf_counter() - t0, time.thread_time() - c0
        return seconds, cpu, chain.seconds, res.state_bytes_sent

    runs = {
        "attn_parallel": ("attn", "parallel"),
        "attn_serial": ("attn", "serial"),
        "hybrid": ("hybrid", "serial"),
    }
    step("hybrid", "serial")  # warm-up
    measured, alone = {k: [] for k in runs}, []
    for _ in range(a.repeats):  # interleaved, so that the load of a shared machine falls on each alike
        for key, (name, schedule) in runs.items():
            dist.barrier()
            measured[key].append(step(name, schedule))
        dist.barrier()
        if rank == 0:
            alone.append(step("hybrid", "serial", on=alone_group))
        dist.barrier()
    med = lambda xs, i: statistics.median(x[i] for x in xs) if xs else None  # noqa: E731
    record = {"rank": rank, "world": world, "alone_s": med(alone, 0), "alone_cpu_s": med(alone, 1)}
    for key, xs in measured.items():
        record |= {f"{key}_s": med(xs, 0), f"{key}_cpu_s": med(xs, 1)}
    record |= {"chain_s": med(measured["hybrid"], 2), "chain_bytes": measured["hybrid"][-1][3]}
    for r in range(world):
        if r == rank:
            print("RESULT " + json.dumps(record), flush=True)
        dist.barrier()
    dist.destroy_process_group()


def _hybrid_report(a: argparse.Namespace, ranks: list[dict]) -> None:
    alone, alone_cpu = ranks[0]["alone_s"], ranks[0]["alone_cpu_s"]
    rows = [
        {
            "rank": r["rank"],
            "attn_parallel_vs_serial": r["attn_serial_s"] / r["attn_parallel_s"],
            "hybrid_s": r["hybrid_s"],
            "hybrid_one_rank_s": alone,
            "hybrid_vs_one_rank": alone / r["hybrid_s"],
            "hybrid_cpu_share": r["hybrid_cpu_s"] / alone_cpu,
            "chain_s": r["chain_s"],
            "chain_share": r["chain_s"] / r["hybrid_s"],
            "chain_KB_sent": r["chain_bytes"] / 1e3,
        }
        for r in ranks
    ]
    print(
        f"C = {a.ranks} gloo ranks, one thread each; P = {a.prompt}, block {a.block}, {a.group} x {a.response} "
        f"tokens; median of {a.repeats}; hybrid: Qwen3-Next (serial schedule, state chained), attn: Llama"
    )
    print_table(rows, [(k, "{:.3f}" if isinstance(v, float) else "{}") for k, v in rows[0].items()])
    print(
        json.dumps(
            {
                "benchmark": "long_context_cp --hybrid",
                "machine": machine(),
                "args": vars(a),
                "ranks": ranks,
                "attn_parallel_vs_serial": min(r["attn_parallel_vs_serial"] for r in rows),
                "hybrid_vs_one_rank": alone / max(r["hybrid_s"] for r in ranks),
                "chain_share": max(r["chain_share"] for r in rows),
            }
        )
    )


def _rank_main(a: argparse.Namespace) -> None:
    import time

    import torch
    import torch.distributed as dist

    from forkrl.core.executor.context_parallel import ContextParallelReplay
    from forkrl.core.testing.models import tiny_causal_lm

    torch.set_num_threads(1)  # one core per rank: a rank stands for a device
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_causal_lm(
        "llama-gqa",
        dtype=torch.float32,
        intermediate_size=2 * MODEL["hidden_size"],
        max_position_embeddings=a.prompt + a.response + 8,
        **MODEL,
    )
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, MODEL["vocab_size"], (a.prompt,), generator=g)
    responses = [torch.randint(0, MODEL["vocab_size"], (a.response,), generator=g) for _ in range(a.group)]
    coefs = [torch.randn(a.response, generator=g) for _ in range(a.group)]
    mine = list(range(rank, a.group, world))
    group = dist.new_group(list(range(world)))
    alone_group = dist.new_group([0])

    def step(schedule: str, on=None) -> tuple[float, float, object, int]:
        """(wall seconds, this rank's compute seconds, result, bytes received) of one step."""
        model.zero_grad(set_to_none=True)
        cp = ContextParallelReplay(model, group=on or group, block_size=a.block, schedule=schedule)
        with _Received() as received:
            t0, c0 = time.perf_counter(), time.thread_time()  # one thread computes (gloo waits elsewhere)
            res = cp.backward(
                prompt,
                responses if on else [responses[i] for i in mine],
                coefs if on else [coefs[i] for i in mine],
            )
            seconds, cpu = time.perf_counter() - t0, time.thread_time() - c0
        return seconds, cpu, res, received.bytes

    step("parallel")  # warm-up: kernels, allocator
    times = {"serial": [], "parallel": []}
    cpus = {"serial": [], "parallel": []}
    for _ in range(a.repeats):
        for schedule in ("serial", "parallel"):
            dist.barrier()
            seconds, cpu, res, comm = step(schedule)
            times[schedule].append(seconds)
            cpus[schedule].append(cpu)
            if schedule == "serial":
                serial_res, serial_comm = res, comm
            else:
                parallel_res, parallel_comm = res, comm
    alone, alone_cpu = [], []
    dist.barrier()
    if rank == 0:
        for _ in range(a.repeats):
            seconds, cpu, _, _ = step("parallel", on=alone_group)
            alone.append(seconds)
            alone_cpu.append(cpu)
    dist.barrier()
    cfg = model.config
    heads, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    cached = a.prompt - 1
    lengths = [[a.response] * len(range(r, a.group, world)) for r in range(world)]
    shape = dict(world=world, layers=cfg.num_hidden_layers, heads=heads, d=d, b=4, pb=4)
    record = {
        "rank": rank,
        "world": world,
        "serial_s": statistics.median(times["serial"]),
        "parallel_s": statistics.median(times["parallel"]),
        "alone_s": statistics.median(alone) if alone else None,
        "serial_cpu_s": statistics.median(cpus["serial"]),
        "parallel_cpu_s": statistics.median(cpus["parallel"]),
        "alone_cpu_s": statistics.median(alone_cpu) if alone_cpu else None,
        "shard_parallel": parallel_res.shard_bytes,
        "shard_serial": serial_res.shard_bytes,
        "comm_parallel": parallel_comm,
        "comm_serial": serial_comm,
        "predicted_parallel": comm_bytes("parallel", cached, a.block, lengths, rank, shape),
        "predicted_serial": comm_bytes("serial", cached, a.block, lengths, rank, shape),
    }
    for r in range(world):  # one rank at a time: records must not interleave on the shared stdout
        if r == rank:
            print("RESULT " + json.dumps(record), flush=True)
        dist.barrier()
    dist.destroy_process_group()


def machine_parallelism(processes: int, size: int = 768, reps: int = 30) -> float:
    """How much faster ``processes`` single-thread matmul processes run at once than one after
    another (``processes`` on a machine with as many free cores; about 1 where they share one)."""
    import subprocess
    import time

    code = (
        "import torch, time\ntorch.set_num_threads(1)\n"
        f"a = torch.randn({size}, {size})\nfor _ in range({reps}): a @ a\n"
    )
    run = [sys.executable, "-c", code]
    t0 = time.perf_counter()
    subprocess.run(run, check=True)
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    procs = [subprocess.Popen(run) for _ in range(processes)]
    for p in procs:
        p.wait()
    together = time.perf_counter() - t0
    return processes * one / together


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    if os.environ.get(RANK_FLAG) == "1":
        (_hybrid_rank_main if a.hybrid else _rank_main)(a)
        return
    ranks = sorted(
        run_ranks("benchmarks.long_context_cp", RANK_FLAG, ranks=a.ranks, timeout=1800),
        key=lambda r: r["rank"],
    )
    if a.hybrid:
        _hybrid_report(a, ranks)
        return
    alone, alone_cpu = ranks[0]["alone_s"], ranks[0]["alone_cpu_s"]
    scaling = machine_parallelism(a.ranks)
    rows = []
    for r in ranks:
        rows.append(
            {
                "rank": r["rank"],
                "serial_s": r["serial_s"],
                "parallel_s": r["parallel_s"],
                "one_rank_s": alone,
                "parallel_vs_serial": r["serial_s"] / r["parallel_s"],
                "parallel_cpu_s": r["parallel_cpu_s"],
                "cpu_share_of_one_rank": r["parallel_cpu_s"] / alone_cpu,
                "cache_KB": r["shard_parallel"] / 1e3,
                "comm_parallel_MB": r["comm_parallel"] / 1e6,
                "comm_serial_MB": r["comm_serial"] / 1e6,
            }
        )
    print(
        f"C = {a.ranks} gloo ranks, one thread each; P = {a.prompt}, block {a.block}, {a.group} x {a.response} tokens; "
        f"median of {a.repeats}"
    )
    print_table(rows, [(k, "{:.3f}" if isinstance(v, float) else "{}") for k, v in rows[0].items()])
    print(
        f"This machine runs {a.ranks} single-thread matmul processes at once {scaling:.2f}x as fast as one "
        f"(ideal {a.ranks}x): wall-clock gains need that many real devices; cpu_share_of_one_rank is the "
        f"compute each rank does against one rank doing it all (ideal 1/{a.ranks})."
    )
    speedup = min(r["parallel_vs_serial"] for r in rows)
    print(
        json.dumps(
            {
                "benchmark": "long_context_cp",
                "machine": machine(),
                "args": vars(a),
                "ranks": ranks,
                "parallel_vs_serial": speedup,
                "parallel_vs_one_rank": alone / max(r["parallel_s"] for r in ranks),
                "cpu_share": max(r["parallel_cpu_s"] for r in ranks) / alone_cpu,
                "machine_parallelism": scaling,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
