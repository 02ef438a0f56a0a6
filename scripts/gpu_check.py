"""One prepared GPU run of everything forkrl can only check on a GPU, at most
8 minutes on one H100 or H200.

Runs from a plain copy of the working tree: no install step, no network (forkrl is mapped from the
tree's folders when it is not installed; the wheels of ``scripts/gpu_wheels.sh``, carried as
``build/gpu_wheels``, are unpacked and appended to ``sys.path``). Each stage has its own time
budget, is skipped when the run's budget left is under its minimum, and its result (or its error)
is written to ``<out>/gpu_check.json`` as soon as it ends (and as it goes), so a run cut short still
reports what it did. The profiles go to ``<out>/gpu_check_profiles.md``. The end of the output is a
table per training shape, then one line of JSON.

    bash scripts/gpu_wheels.sh                                   # here, once: build/gpu_wheels (2 MB)
    python scripts/gpu_check.py --out "$OUT"                     # the GPU run (carry build/gpu_wheels)
    python scripts/gpu_check.py --out /tmp/g --device cpu --tiny # the CPU smoke test CI runs

Stages (``--stages`` picks some), in run order, with their budget / minimum seconds and, in
brackets, what one H100 should take (estimated from the FLOP counts and the H200 run of
2026-12-04, benchmarks/results/gpu.md; not yet measured). The defaults (450 s) hold them all but,
where the estimates run long, the last ones (drafter, then long_context) are skipped:
    env           10 /  5  (1)    versions, device, memory, attention kernels, carried wheels
    ops           20 /  5  (2)    the flash op's output, log-sum-exp and backward against float64
    attention     20 /  5  (1)    forkrl's split attention against sdpa with a mask (bf16, float32)
    train_0.5b   100 / 40  (75)   Qwen2.5-0.5B widths, bf16, one group P=8192 G=16 R=512
    train_7b     110 / 50  (70)   Qwen2.5-7B widths, bf16, one group P=4096 G=8 R=1024 (13 of 28
                                  layers on an H100, 27 on an H200: below)
    train_math   100 / 40  (100)  0.5B widths, math RL: 32 groups x G=8, P=256, R=512
    trl           70 / 40  (30)   stock trl.GRPOTrainer vs forkrl tree_packing, 0.5B widths, P=2048
                                  G=8 R=512, bf16 (skipped with the reason when trl does not import)
    exactness     50 / 30  (31)   keep / replay / packed against per-sequence autograd, tiny models
    precision     30 / 20  (17)   the tree under bf16/fp16 autocast against stock (test_precision)
    long_context  60 / 30  (42)   replay with the exact prompt gradient: memory at G=2 and G=8,
                                  then the longest prompt the budget reaches
    drafter       60 / 30  (59)   int4/int8 kernels, the drafter's matmul time, greedy equality
``--tiny`` multiplies the budgets by 4 and runs on one thread (a shared CPU).

The training stages (scripts/gpu/training.py) compare dense, keep, replay, packed and Prefix
Grouper on one model: executors built and verified before the clock, a warm-up call of each at
the full shape with its gradient checked against dense's, then at least 3 rounds with the methods
alternating call by call, each call between CUDA events, the median reported; then one profiled
call per method (device busy = the union of kernel intervals). Per method: median ms, device-busy
ms, FLOPs, achieved x (dense time over the method's), ideal x (dense FLOPs over the method's),
achieved/ideal, peak GiB, gradient error. The 7B widths keep 28 layers only where every method's
predicted peak fits 90% of the card (scripts/gpu/shapes.py); otherwise the layers are cut and the
stage's ``memory_plan.cut`` says from what, to what and why.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _import_forkrl() -> str:
    """``forkrl`` from this tree: installed (editable) or mapped from its folders."""
    sys.path.insert(0, str(REPO))  # benchmarks/
    try:
        import forkrl.core  # noqa: F401

        return "installed"
    except ImportError:
        pass
    for name, folder in (("forkrl", "forkrl"), ("forkrl.core", "core"), ("forkrl.plugins", "plugins")):
        spec = importlib.util.spec_from_file_location(
            name, REPO / folder / "__init__.py", submodule_search_locations=[str(REPO / folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        if "." in name:
            setattr(sys.modules["forkrl"], name.split(".")[1], module)
        spec.loader.exec_module(module)
    return "mapped from the tree"


class StageTimeout(BaseException):
    """A stage ran past its budget (raised between Python steps by an alarm). A BaseException, as
    KeyboardInterrupt is: library code's ``except Exception`` must not take it for its own failure
    (forkrl's first-use probe once read it as 'split attention disagrees' and fell back to a mask)."""


@contextlib.contextmanager
def _alarm(seconds: float):
    def fire(signum, frame):
        raise StageTimeout(f"stage budget of {seconds:.0f} s exceeded")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Report:
    """Results by stage, rewritten to ``gpu_check.json`` after each stage."""

    def __init__(self, out: Path, args) -> None:
        self.path = out / "gpu_check.json"
        self.data: dict = {"args": vars(args), "stages": {}}
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check_profiles.md").unlink(missing_ok=True)  # the training stages append to it
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def stage(self, name: str, result: dict) -> None:
        self.data["stages"][name] = result
        self.write()
        if result.get("status") != "running":
            print(
                f"[gpu_check] {name}: {result.get('status')} ({result.get('seconds', 0):.1f} s)", flush=True
            )


#: name -> (module, function, budget seconds, minimum seconds): a stage runs when the run's budget
#: left is at least its minimum, for at most min(budget, left).
STAGES = {
    "env": ("checks", "stage_env", 10, 5),
    "ops": ("checks", "stage_ops", 20, 5),
    "attention": ("checks", "stage_attention", 20, 5),
    "train_0.5b": ("training", "stage_train_05b", 100, 40),
    "train_7b": ("training", "stage_train_7b", 110, 50),
    "train_math": ("training", "stage_train_math", 100, 40),
    "trl": ("trl_stage", "stage_trl", 70, 40),
    "exactness": ("checks", "stage_exactness", 50, 30),
    "precision": ("checks", "stage_precision", 30, 20),
    "long_context": ("checks", "stage_long_context", 60, 30),
    "drafter": ("checks", "stage_drafter", 60, 30),
}


#: ``--stages`` names standing for several stages.
ALIASES = {"training": ["train_0.5b", "train_7b", "train_math"]}
#: ``--tiny`` stage budgets over the GPU's.
TINY_BUDGET_FACTOR = 4


class Context:
    """What a stage sees: the device, the sizes, the clock, the report."""

    def __init__(self, device, tiny: bool, deadline: float, report: Report, forkrl_source: str, wheels: dict):
        self.device, self.tiny, self.deadline = device, tiny, deadline
        self.report, self.forkrl_source, self.wheels = report, forkrl_source, wheels
        self.current = ""
        self.stage_deadline = deadline

    def left(self) -> float:
        return min(self.deadline, self.stage_deadline) - time.monotonic()

    def partial(self, result: dict) -> None:
        """Write a stage's result so far (a later timeout keeps it)."""
        self.report.stage(self.current, {"status": "running", **result})


def _stage_fn(name: str):
    import importlib

    module, fn, _, _ = STAGES[name]
    return getattr(importlib.import_module(f"gpu.{module}"), fn)


def _run_stage(ctx: Context, name: str) -> str:
    """Run one stage under its budget; returns its status (its result is in the report)."""
    _, _, budget, minimum = STAGES[name]
    if ctx.tiny:  # the budgets are the GPU's; a shared CPU may run the smoke sizes far slower
        budget *= TINY_BUDGET_FACTOR
    left = ctx.deadline - time.monotonic()
    if left < minimum:
        ctx.report.stage(
            name, {"status": "skipped", "why": f"{left:.0f} s left of the run's budget (needs {minimum})"}
        )
        return "skipped"
    ctx.current, t0 = name, time.monotonic()
    ctx.stage_deadline = t0 + min(budget, left)
    try:
        with _alarm(min(budget, left)):
            result = _stage_fn(name)(ctx)
        status = result.pop("status", "ok")
    except (Exception, StageTimeout) as err:  # noqa: BLE001 - every failure is a result of the check
        previous = ctx.report.data["stages"].get(name, {})
        result = {k: v for k, v in previous.items() if k != "status"}
        result["error"] = "".join(traceback.format_exception_only(type(err), err)).strip()[-2000:]
        result["traceback"] = traceback.format_exc()[-4000:]
        status = "timeout" if isinstance(err, StageTimeout) else "error"
    from gpu.checks import free

    free(ctx.device)
    ctx.report.stage(name, {"status": status, "seconds": time.monotonic() - t0, **result})
    return status


def _summary(stages: dict) -> dict:
    keys = ("ms", "busy_ms", "achieved_x", "ideal_x", "achieved_over_ideal", "peak_gib", "grad_error")
    out = {}
    for name, result in stages.items():
        if "rows" in result:
            out[name] = {r["method"]: {k: r[k] for k in keys if k in r} for r in result["rows"]}
            out[name]["token_ratio"] = result.get("token_ratio")
        elif name == "trl" and "speedup" in result:
            out[name] = {k: result[k] for k in ("stock_ms", "tree_ms", "speedup", "grad_error")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check_profiles.md")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    ap.add_argument(
        "--tiny", action="store_true", help="tiny shapes of the same structure (the CPU smoke test)"
    )
    ap.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # the old name of --tiny
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma list of: {', '.join(STAGES)}")
    ap.add_argument(
        "--wheels",
        default=str(REPO / "build" / "gpu_wheels"),
        help="folder of scripts/gpu_wheels.sh's wheels",
    )
    args = ap.parse_args()
    args.tiny = args.tiny or args.quick
    stages = [t for s in args.stages.split(",") for t in ALIASES.get(s, [s])]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        hint = " (each training stage now profiles its own methods)" if "profile" in unknown else ""
        ap.error(f"unknown stage(s) {unknown}{hint}: pick from {', '.join(STAGES)}, or 'training'")
    # Alternating methods of very different shapes near the card's capacity fragments the default
    # allocator's segments; set before torch starts CUDA (a value already set is kept).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    start = time.monotonic()
    report = Report(Path(args.out), args)
    source = _import_forkrl()
    sys.path.insert(0, str(REPO / "scripts"))  # the stages: scripts/gpu as the package `gpu`
    from gpu.training import print_tables
    from gpu.trl_stage import print_trl
    from gpu.wheels import put_on_path

    wheels = put_on_path(Path(args.wheels))
    wheels["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    import torch

    if args.tiny:
        # Many small ops, each split over every core, wait for the slowest thread whenever another
        # process holds a core (20 s became 160 s on a shared 2-core machine): one thread.
        torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        report.stage("env", {"status": "error", "error": "CUDA is not available", "seconds": 0.0})
        sys.exit(1)
    ctx = Context(device, args.tiny, start + args.budget, report, source, wheels)
    statuses = [_run_stage(ctx, name) for name in stages]
    failed = statuses.count("error")
    report.data["seconds"] = time.monotonic() - start
    report.write()
    print_tables(report.data["stages"])
    print_trl(report.data["stages"].get("trl", {}))
    print()
    print(
        json.dumps(
            {
                "gpu_check": str(report.path),
                "failed": failed,
                "statuses": dict(zip(stages, statuses, strict=True)),
                "seconds": report.data["seconds"],
                "summary": _summary(report.data["stages"]),
            }
        )
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
