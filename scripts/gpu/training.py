"""The training stages: one per shape (``train_0.5b``, ``train_7b``, ``train_math``), each dense,
keep, replay, packed and Prefix Grouper side by side on one random-weight model.

A stage, in order (only step 5 is timed):
1. the memory plan: the layers at which every method fits (``shapes.plan_layers``; the 7B widths
   are cut on a 78 GiB card, and the output says so and why);
2. the model (bf16 on the device) and the batch; each method's FLOPs (``shapes.method_flops``);
3. every method built: executors constructed and verified (their first-use probe), packed forests
   and Prefix Grouper layouts (``methods.build``);
4. one warm-up call of each method at the full shape (kernels, FlexAttention's compile, the
   allocator's pool), which also checks its gradient against dense's: max |grad - dense| over
   max |dense| (bf16 rounding puts a right method near 1e-2; a wrong one is near 1);
5. at least 3 rounds, the methods alternating call by call, each call between CUDA events
   (``measure.time_rounds``); no ``empty_cache`` anywhere between step 4 and the last round;
6. one profiled call per method: device busy as the union of kernel intervals, the phases, the
   top kernels (``measure.profile_call``), appended to ``<out>/gpu_check_profiles.md``.

Per method the table reports: median ms, device-busy ms, FLOPs, TFLOP/s, achieved x (dense's
median over the method's), ideal x (dense's FLOPs over the method's), achieved/ideal, peak GiB,
the gradient error; and the token ratio (the forest's compression) once per shape.
"""

from __future__ import annotations

import statistics
import time

from . import measure
from .methods import build
from .shapes import (
    GIB,
    METHODS,
    build_batch,
    build_model,
    method_flops,
    plan_layers,
    tiny_or_full,
    with_layers,
)

#: Seconds one method's profiled call may take, as a multiple of its median (profiler overhead
#: plus reading the events).
PROFILE_FACTOR = 4.0
MIN_ROUNDS, MAX_ROUNDS = 3, 7


def _setup(ctx, name: str, out: dict):
    import torch

    dev, tiny = ctx.device, ctx.tiny
    shape = tiny_or_full(name, tiny)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    element = torch.finfo(dtype).bits // 8
    memory = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
    plan = plan_layers(shape, METHODS, element, memory)
    if plan["layers"] < 1:
        raise RuntimeError(plan["cut"])
    shape = with_layers(shape, plan["layers"])
    out.update(shape=shape.describe(), dtype=str(dtype), memory_plan=plan)
    t0 = time.monotonic()
    batch = build_batch(shape)
    model = build_model(shape.widths, plan["layers"], dev, dtype, shape.row)
    out["model"] = {
        "params": sum(p.numel() for p in model.parameters()),
        "layers": plan["layers"],
        "hidden": shape.widths.hidden,
        "vocab": shape.widths.vocab,
        "tied": shape.widths.tied,
    }
    out["token_ratio"] = batch.forest.compression
    flops = method_flops(model.config, batch, shape, METHODS)
    built = build(model, batch, shape, dev, METHODS)
    out["setup_s"] = time.monotonic() - t0
    out["skipped"] = built.skipped
    out["notes"] = built.notes
    return shape, model, flops, built


def _warm_up(ctx, model, built, out: dict) -> None:
    """One call per method at the full shape, gradients checked against dense's."""
    import torch

    dev = ctx.device
    ref, seconds, errors = None, {}, {}
    for m, run in built.runs.items():
        model.zero_grad(set_to_none=True)
        t0 = time.monotonic()
        try:
            measure.timed_call(run, dev)
        except Exception as err:  # noqa: BLE001 - one method's failure (out of memory, a kernel) is its result
            what = "out of memory" if isinstance(err, torch.OutOfMemoryError) else type(err).__name__
            errors[m] = f"{what} in the warm-up: {str(err)[:300]}"
            model.zero_grad(set_to_none=True)
            continue
        seconds[m] = time.monotonic() - t0
        if m == "dense":
            ref = measure.grads_to_host(model)
        elif ref is not None:
            out.setdefault("grad_error", {})[m] = measure.grad_error(model, ref)
        out["warm_up_s"] = seconds
        ctx.partial(out)
    for m in errors:
        built.runs.pop(m)
    out["errors"] = errors
    model.zero_grad(set_to_none=True)


def _time(ctx, model, built, out: dict) -> measure.Timings:
    """At least :data:`MIN_ROUNDS` rounds, then more (up to :data:`MAX_ROUNDS`; ``--tiny``: the
    minimum) while the stage's time left holds another round beside the profile."""
    t = measure.Timings.of(built.runs)
    r = 0
    most = MIN_ROUNDS if ctx.tiny else MAX_ROUNDS
    while r < MIN_ROUNDS or (r < most and ctx.left() > (PROFILE_FACTOR + 1) * t.round_seconds() + 10):
        measure.time_round(built.runs, model, ctx.device, r, t)
        r += 1
        out["rounds"], out["ms"], out["host_ms"] = r, t.ms, t.host_ms
        ctx.partial(out)
    return t


def _row(m: str, flops: dict, timings: measure.Timings, profiles: dict, grad_errors: dict) -> dict:
    ms, dense_ms = timings.median(m), timings.median("dense")
    row = {"method": m, "calls": len(timings.ms[m]), "flops": flops[m]}
    if ms is not None:
        row.update(ms=ms, host_ms=statistics.median(timings.host_ms[m]), tflops_per_s=flops[m] / ms / 1e9)
        if dense_ms:
            row["achieved_x"] = dense_ms / ms
    if m in profiles:
        # On a GPU, kernel time over the unprofiled call's median (host overhead does not lengthen
        # kernels); on the CPU the stand-in host ops are slowed by the profiler itself: over the
        # profiled call's own time.
        p = profiles[m]
        row["busy_ms"] = p["busy_ms"]
        denominator = ms if p["busy_of"] == "CUDA kernels" else p.get("call_ms")
        if denominator:
            row["busy_share"] = p["busy_ms"] / denominator
    if flops.get("dense"):
        row["ideal_x"] = flops["dense"] / flops[m]
        if "achieved_x" in row:
            row["achieved_over_ideal"] = row["achieved_x"] / row["ideal_x"]
    if m in timings.peak_gib:
        row["peak_gib"] = timings.peak_gib[m]
    row["grad_error"] = 0.0 if m == "dense" else grad_errors.get(m)
    return {k: v for k, v in row.items() if v is not None}


def _table(out: dict, flops: dict, timings: measure.Timings, profiles: dict) -> list[dict]:
    return [_row(m, flops, timings, profiles, out.get("grad_error", {})) for m in timings.ms]


def _profiles(ctx, name: str, model, built, timings: measure.Timings, out: dict) -> dict:
    profiles = {}
    path = ctx.report.path.parent / "gpu_check_profiles.md"
    for m, run in built.runs.items():
        ms = timings.median(m) or 0.0
        if ctx.left() < PROFILE_FACTOR * ms / 1e3 + 5:
            out.setdefault("profile_skipped", []).append(m)
            continue
        p = measure.profile_call(run, model, ctx.device)
        profiles[m] = p
        with path.open("a") as f:
            f.write(measure.profile_text(f"{name}: {m}", p))
        out["profile"] = {k: {**v, "top": v["top"][:5]} for k, v in profiles.items()}
        ctx.partial(out)
    return profiles


def stage_training(ctx, name: str) -> dict:
    """Set up, warm up, time and profile every method at the shape ``name`` (module docstring)."""
    out: dict = {}
    shape, model, flops, built = _setup(ctx, name, out)
    out["flops"] = flops
    ctx.partial(out)
    _warm_up(ctx, model, built, out)
    if "prefix_grouper" in built.runs:
        from benchmarks.prefix_grouper_compare import FLASH_GQA

        out["notes"]["prefix_grouper"] += f", GQA {FLASH_GQA[0] or 'not needed'}"
    timings = _time(ctx, model, built, out)
    out["errors"].update(timings.errors)
    out["rows"] = _table(out, flops, timings, {})
    ctx.partial(out)
    profiles = _profiles(ctx, name, model, built, timings, out)
    out["rows"] = _table(out, flops, timings, profiles)
    return out


def stage_train_05b(ctx) -> dict:
    return stage_training(ctx, "0.5b")


def stage_train_7b(ctx) -> dict:
    return stage_training(ctx, "7b")


def stage_train_math(ctx) -> dict:
    return stage_training(ctx, "math")


TABLE_COLUMNS = [
    ("method", "{}"),
    ("ms", "{:.1f}"),
    ("busy_ms", "{:.1f}"),
    ("busy_share", "{:.2f}"),
    ("flops", "{:.3g}"),
    ("tflops_per_s", "{:.1f}"),
    ("achieved_x", "{:.2f}"),
    ("ideal_x", "{:.2f}"),
    ("achieved_over_ideal", "{:.2f}"),
    ("peak_gib", "{:.1f}"),
    ("grad_error", "{:.1e}"),
]


def print_tables(stages: dict) -> None:
    """Each training stage's table (Markdown), with its shape line and what was cut or skipped."""
    for name, result in stages.items():
        if not name.startswith("train_") or "rows" not in result:
            continue
        s = result.get("shape", {})
        print(
            f"\n{name}: {s.get('model')} x{result.get('model', {}).get('layers')} layers, P={s.get('P')} "
            f"G={s.get('G')} R={s.get('R')} groups={s.get('groups')}, token ratio "
            f"{result.get('token_ratio', 0):.2f}, median of {result.get('rounds')} calls, {result.get('dtype')}"
        )
        cut = result.get("memory_plan", {}).get("cut")
        if cut:
            print(f"  {cut}")
        rows = result["rows"]
        cols = [(c, f) for c, f in TABLE_COLUMNS if any(c in r for r in rows)]
        print("| " + " | ".join(c for c, _ in cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(f.format(r[c]) if c in r else "-" for c, f in cols) + " |")
        for m, why in {**result.get("skipped", {}), **result.get("errors", {})}.items():
            print(f"  {m}: {why}")


__all__ = ["GIB", "print_tables", "stage_train_05b", "stage_train_7b", "stage_train_math"]
