"""Timing, the gradient check and the profiler's reading, for the training stages.

Timing: each call is bracketed by CUDA events recorded on the current stream (the device's time
from the call's first enqueued work to its last, host gaps included, which is what a training step
costs); ``torch.cuda.synchronize`` runs only before the first event and after the second, outside
the timed region. Gradients are set to None and peak-memory statistics reset before each call,
also outside. Methods alternate call by call, each round starting one method later, and each
method's figure is the median of its calls. On the CPU (``--tiny``) a call is timed by
``time.perf_counter``.

Device busy: the union of the intervals of the device's kernels (CUDA kernel events of
torch.profiler, memcpy/memset and annotations left out; overlapping kernels counted once), not the
sum of the profiler's op rows (an op row and its kernel rows would count the same time twice).
Phases: the executor's ``record_function`` labels (:data:`LABELS`, present when the executor
provides them): a kernel belongs to a phase when the host call that launched it (matched by
correlation id) lies inside one of the phase's host ranges, whatever thread launched it (autograd
runs backward on its own thread).

This module imports nothing beyond the standard library at import time (its tests load it alone).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

#: ``record_function`` labels the executor may set around its phases (optional: read when present).
LABELS = (
    "forkrl.prompt_forward",
    "forkrl.leaves_forward",
    "forkrl.head",
    "forkrl.leaves_backward",
    "forkrl.prompt_backward",
)
CALL_LABEL = "gpu_check.call"


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals, overlaps counted once."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


# ---------------------------------------------------------------------------- timing


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], object], device) -> tuple[float, float]:
    """(device ms, host ms) of one call: CUDA events on the device (perf_counter on the CPU), and
    the host's time to enqueue it. Synchronizes before and after, outside the events."""
    import torch

    _sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return ms, ms
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    h0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - h0) * 1e3
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end), host


def _peak_reset(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


@dataclass
class Timings:
    """Per method: device ms and host ms of each timed call, the peak allocated GiB over its calls
    (weights included), and the error that stopped it."""

    ms: dict[str, list[float]]
    host_ms: dict[str, list[float]]
    peak_gib: dict[str, float]
    errors: dict[str, str]

    @classmethod
    def of(cls, methods: Iterable[str]) -> Timings:
        return cls({m: [] for m in methods}, {m: [] for m in methods}, {}, {})

    def median(self, method: str) -> float | None:
        return statistics.median(self.ms[method]) if self.ms.get(method) else None

    def round_seconds(self) -> float:
        """One round's seconds: the sum of the methods' medians."""
        return sum(self.median(m) or 0.0 for m in self.ms) / 1e3


def time_round(runs: dict[str, Callable[[], object]], model, device, r: int, t: Timings) -> None:
    """Round ``r``: one call of every method, alternating call by call (starting at method r), into ``t``."""
    import torch

    names = [m for m in runs if m not in t.errors]
    k = r % len(names) if names else 0
    for m in names[k:] + names[:k]:
        model.zero_grad(set_to_none=True)
        _peak_reset(device)
        try:
            ms, host = timed_call(runs[m], device)
        except Exception as err:  # noqa: BLE001 - one method's failure is its result; the others go on
            what = "out of memory" if isinstance(err, torch.OutOfMemoryError) else type(err).__name__
            t.errors[m] = f"{what} in round {r}: {str(err)[:300]}"
            model.zero_grad(set_to_none=True)
            continue
        t.ms[m].append(ms)
        t.host_ms[m].append(host)
        peak = _peak_gib(device)
        if peak is not None:
            t.peak_gib[m] = max(t.peak_gib.get(m, 0.0), peak)
    model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------- gradients


def grads_to_host(model) -> list:
    """A host copy of every parameter's gradient (None where there is none), in its own dtype."""
    return [p.grad.detach().to("cpu", copy=True) if p.grad is not None else None for p in model.parameters()]


def grad_error(model, ref: list, chunk: int = 1 << 26) -> float:
    """max |grad - ref| over all parameters, over max |ref|: compared on the device in float32, a
    chunk of ``chunk`` elements at a time (a 7B embedding's float32 copy would not fit beside
    everything else)."""
    import torch

    diff, scale = 0.0, 0.0
    for p, r in zip(model.parameters(), ref, strict=True):
        if r is None:
            if p.grad is not None:
                diff = max(diff, float(p.grad.detach().abs().max()))
            continue
        g = p.grad.detach().reshape(-1) if p.grad is not None else None
        r = r.reshape(-1)
        for i in range(0, r.numel(), chunk):
            rc = r[i : i + chunk].to(p.device, torch.float32)
            scale = max(scale, float(rc.abs().max()))
            gc = g[i : i + chunk].float() if g is not None else torch.zeros_like(rc)
            diff = max(diff, float((gc - rc).abs().max()))
    return diff / scale if scale else diff


# ---------------------------------------------------------------------------- the profiler


@dataclass(frozen=True)
class Event:
    """One profiler event: ``kind`` is "kernel", "memcpy", "memset" (device), "launch" (the host's
    runtime/driver call), "label" (a ``record_function`` range), "op" (a host op) or "other"."""

    name: str
    kind: str
    start_us: float
    end_us: float
    correlation: int


def _kind(name: str, device_side: bool, activity, labels: set[str]) -> str:
    """An event's kind from kineto's activity type ("kernel", "gpu_memcpy", "cuda_runtime",
    "cpu_op", "gpu_user_annotation", ...; matched by substring, whatever form this torch gives it),
    or from its name on a torch without activity types."""
    act = str(activity).lower() if activity else ""
    low = name.lower()
    if device_side:
        if name in labels or "annotation" in act:
            return "other"
        for kind in ("memcpy", "memset", "kernel"):
            if kind in act or (not act and kind in low):
                return kind
        return "kernel" if not act and "sync" not in low else "other"
    if name in labels:
        return "label"
    if "runtime" in act or "driver" in act or (not act and name.startswith("cu") and "Launch" in name):
        return "launch"
    if "cpu_op" in act or (not act and name.startswith("aten::")):
        return "op"
    return "other"


def read_events(prof, labels: set[str]) -> list[Event]:
    """The profile's events from kineto's raw results (cheap: no FunctionEvent tree is built),
    or, on a torch without them, from ``prof.events()``."""
    from torch.autograd import DeviceType

    out = []
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is not None and hasattr(raw, "events"):
        for e in raw.events():
            name = e.name()
            device_side = e.device_type() != DeviceType.CPU
            activity = e.activity_type() if hasattr(e, "activity_type") else None
            start = e.start_ns() / 1e3
            out.append(
                Event(
                    name,
                    _kind(name, device_side, activity, labels),
                    start,
                    start + e.duration_ns() / 1e3,
                    int(e.correlation_id()),
                )
            )
        return out
    for e in prof.events():
        device_side = e.device_type != DeviceType.CPU
        kind = _kind(e.name, device_side, getattr(e, "activity_type", None), labels)
        out.append(Event(e.name, kind, e.time_range.start, e.time_range.end, int(e.id)))
    return out


def analyze(events: list[Event], labels: Iterable[str], device_type: str, top: int = 15) -> dict:
    """Device busy (kernel union), per phase label and the top kernels of one profiled call.

    On the CPU there are no kernels: host ops stand in for them (``busy_of`` says which), so the
    same reading runs in ``--tiny``."""
    work_kind = "kernel" if device_type == "cuda" else "op"
    work = [e for e in events if e.kind == work_kind]
    launch_at = {e.correlation: e.start_us for e in events if e.kind == "launch"}

    def issued(e: Event) -> float:
        return launch_at.get(e.correlation, e.start_us) if work_kind == "kernel" else e.start_us

    out = {
        "busy_of": "CUDA kernels" if work_kind == "kernel" else "host ATen ops (no device)",
        "busy_ms": union_length((e.start_us, e.end_us) for e in work) / 1e3,
        "kernels": len(work),
        "launches": sum(e.kind == "launch" for e in events),
        # kernels whose launch was found (by correlation id): the phases' attribution rests on it
        "matched_to_launch": sum(e.correlation in launch_at for e in work) if work_kind == "kernel" else None,
        "host_ops": sum(e.kind == "op" for e in events),
        "memcpy_ms": sum(e.end_us - e.start_us for e in events if e.kind == "memcpy") / 1e3,
        "memset_ms": sum(e.end_us - e.start_us for e in events if e.kind == "memset") / 1e3,
    }
    calls = [e for e in events if e.kind == "label" and e.name == CALL_LABEL]
    if calls:
        out["call_ms"] = sum(e.end_us - e.start_us for e in calls) / 1e3
    phases = {}
    for label in labels:
        ranges = sorted((e.start_us, e.end_us) for e in events if e.kind == "label" and e.name == label)
        if not ranges:
            continue
        mine = [e for e in work if _inside(issued(e), ranges)]
        phases[label] = {
            "calls": len(ranges),
            "host_ms": sum(b - a for a, b in ranges) / 1e3,
            "busy_ms": union_length((e.start_us, e.end_us) for e in mine) / 1e3,
            "kernels": len(mine),
        }
    out["phases"] = phases
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in work:
        row = by_name[e.name]
        row[0] += 1
        row[1] += e.end_us - e.start_us
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    out["top"] = [{"name": n[:120], "count": c, "ms": us / 1e3} for n, (c, us) in ranked]
    return out


def _inside(t: float, ranges: list[tuple[float, float]]) -> bool:
    import bisect

    i = bisect.bisect_right(ranges, (t, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= t <= ranges[i][1]


def profile_call(fn: Callable[[], object], model, device) -> dict:
    """One call of ``fn`` under torch.profiler (host ops, and CUDA kernels on a GPU), read by
    :func:`analyze`; ``wall_ms`` is the profiled call's own time (profiler overhead included)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    model.zero_grad(set_to_none=True)
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        with record_function(CALL_LABEL):
            fn()
        _sync(device)
    wall = (time.perf_counter() - t0) * 1e3
    t1 = time.perf_counter()
    labels = {*LABELS, CALL_LABEL}
    result = analyze(read_events(prof, labels), LABELS, device.type)
    result["wall_ms"] = wall
    result["read_s"] = time.perf_counter() - t1
    model.zero_grad(set_to_none=True)
    return result


def profile_text(title: str, p: dict) -> str:
    """A profile as Markdown: the summary, the phases, the top kernels."""
    lines = [
        f"### {title}",
        "",
        f"busy ({p['busy_of']}): {p['busy_ms']:.1f} ms of a {p['wall_ms']:.1f} ms profiled call; "
        f"{p['kernels']} kernels, {p['launches']} launches, {p['host_ops']} host ops; "
        f"memcpy {p['memcpy_ms']:.1f} ms, memset {p['memset_ms']:.1f} ms",
        "",
    ]
    if p["phases"]:
        lines += ["| phase | calls | host ms | busy ms | kernels |", "|---|---|---|---|---|"]
        lines += [
            f"| {k} | {v['calls']} | {v['host_ms']:.1f} | {v['busy_ms']:.1f} | {v['kernels']} |"
            for k, v in p["phases"].items()
        ]
    else:
        lines.append(f"phases: none of the labels {', '.join(LABELS)} were recorded")
    lines += ["", "| kernel | count | ms |", "|---|---|---|"]
    lines += [f"| `{k['name']}` | {k['count']} | {k['ms']:.2f} |" for k in p["top"]]
    return "\n".join(lines) + "\n\n"
