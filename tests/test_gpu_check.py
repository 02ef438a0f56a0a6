"""scripts/gpu_check.py runs end to end (CPU, ``--tiny``: the GPU run's shapes at CPU size), so the
GPU session's one run is not its first; and the pieces a CPU cannot exercise for real (the kernel
union, phase attribution, the memory plan of the 7B shape) are checked on crafted inputs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
METHODS = ("dense", "keep", "replay", "packed", "prefix_grouper")
TRAINING = ("train_0.5b", "train_7b", "train_math")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu():
    """scripts/gpu as the package ``gpu`` (as gpu_check.py imports it)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu.measure
        import gpu.shapes
        import gpu.wheels  # noqa: F401

        yield gpu
    finally:
        sys.path.remove(str(REPO / "scripts"))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--out", str(out), "--device", "cpu", "--tiny"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return out, proc


@pytest.mark.slow
def test_gpu_check_runs_every_stage_on_cpu(tiny_run):
    out, proc = tiny_run
    stages = json.loads((out / "gpu_check.json").read_text())["stages"]
    failed = {k: v.get("error") for k, v in stages.items() if v["status"] not in ("ok", "skipped")}
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-2000:], proc.stderr[-3000:])
    assert list(stages) == [
        "env",
        "ops",
        "attention",
        *TRAINING,
        "trl",
        "exactness",
        "precision",
        "long_context",
        "drafter",
    ]
    assert all(stages[s]["status"] == "ok" for s in stages if s != "trl"), stages["trl"]
    assert stages["precision"]["criterion_met"], stages["precision"]["worst"]
    assert stages["ops"]["causal_self"]["grad_err"] < 1e-5
    assert stages["attention"]["torch.float32"]["kernel"] == "split"
    assert stages["exactness"]["worst_grad_err"]["torch.float32"] < 1e-4
    assert stages["drafter"]["greedy"]["speculative_equals_plain"]


@pytest.mark.slow
def test_every_training_shape_times_every_method(tiny_run):
    """Each shape's table: every method timed (median of >= 3 alternating calls) and profiled, its
    FLOPs and ratios, its gradient equal to dense's (float32 here); Prefix Grouper is skipped only
    for want of its wheel, with the way to get it."""
    out, proc = tiny_run
    stages = json.loads((out / "gpu_check.json").read_text())["stages"]
    profiles = (out / "gpu_check_profiles.md").read_text()
    for name in TRAINING:
        result = stages[name]
        rows = {r["method"]: r for r in result["rows"]}
        expected = set(METHODS) - set(result["skipped"])
        assert set(rows) == expected, (result["skipped"], result["errors"])
        assert set(result["skipped"]) <= {"prefix_grouper"}, result["skipped"]
        if result["skipped"]:
            assert "gpu_wheels.sh" in result["skipped"]["prefix_grouper"]
        assert result["rounds"] >= 3 and result["memory_plan"]["cut"] is None
        for m, row in rows.items():
            assert row["calls"] == result["rounds"] and row["ms"] > 0, row
            assert row["grad_error"] < 1e-4, (name, m, row)
            assert row["ideal_x"] > 0 and row["achieved_over_ideal"] > 0, row
            assert row["busy_ms"] > 0 and f"### {name.removeprefix('train_')}: {m}" in profiles
        assert rows["dense"]["ideal_x"] == 1.0
        # keep, packed and Prefix Grouper compute the forest's unique work; replay adds its recompute
        assert (
            rows["keep"]["flops"]
            == rows["packed"]["flops"]
            < rows["replay"]["flops"]
            < rows["dense"]["flops"]
        )
        assert rows["keep"]["ideal_x"] > 1.0
    # the last line is JSON with every shape's summary
    summary = json.loads(proc.stdout.strip().splitlines()[-1])["summary"]
    assert set(TRAINING) <= set(summary)
    assert "| method | ms | busy_ms |" in proc.stdout


@pytest.mark.slow
def test_the_trl_stage_runs_or_says_why_not(tiny_run):
    out, _ = tiny_run
    trl = json.loads((out / "gpu_check.json").read_text())["stages"]["trl"]
    if trl["status"] == "skipped":
        assert trl["why"].startswith("import trl failed")
        return
    assert trl["status"] == "ok" and trl["grad_error"] < 1e-4, trl
    assert len(trl["ms"]["stock"]) == len(trl["ms"]["tree"]) >= 2
    assert trl["tree_metrics"]["tree/compression"] > 1


def test_device_busy_is_the_union_of_kernel_intervals(gpu):
    """Overlapping kernels count once; memcpy, annotations and host rows are no kernels; a kernel
    belongs to the phase whose host range holds its launch, whatever thread launched it."""
    m = gpu.measure
    E = m.Event
    events = [
        E("forkrl.leaves_forward", "label", 0, 100, 0),
        E("forkrl.leaves_backward", "label", 100, 300, 0),
        E("cudaLaunchKernel", "launch", 10, 11, 1),
        E("cudaLaunchKernel", "launch", 20, 21, 2),
        E("cudaLaunchKernel", "launch", 150, 151, 3),  # on autograd's thread, inside the backward
        E("gemm", "kernel", 50, 150, 1),
        E("gemm", "kernel", 100, 200, 2),  # overlaps the first: 150 us busy, not 200
        E("softmax", "kernel", 250, 260, 3),
        E("Memcpy DtoD", "memcpy", 260, 400, 0),
        E("aten::mm", "op", 0, 300, 0),
    ]
    p = m.analyze(events, m.LABELS, "cuda")
    assert p["busy_ms"] == pytest.approx(0.160)
    assert p["kernels"] == 3 and p["launches"] == 3 and p["matched_to_launch"] == 3
    assert p["memcpy_ms"] == pytest.approx(0.140)
    assert p["phases"]["forkrl.leaves_forward"] == {"calls": 1, "host_ms": 0.1, "busy_ms": 0.15, "kernels": 2}
    assert p["phases"]["forkrl.leaves_backward"]["kernels"] == 1
    assert "forkrl.head" not in p["phases"]  # an absent label is left out, not zero
    assert p["top"][0] == {"name": "gemm", "count": 2, "ms": 0.2}
    assert m.union_length([]) == 0.0
    assert m.union_length([(0, 1), (2, 3), (0.5, 2.5)]) == 3.0


def test_device_events_are_told_apart_by_activity_or_name(gpu):
    kind = gpu.measure._kind
    labels = set(gpu.measure.LABELS)
    assert kind("ampere_gemm", True, "kernel", labels) == "kernel"
    assert kind("Memcpy HtoD", True, "gpu_memcpy", labels) == "memcpy"
    assert kind("forkrl.head", True, "gpu_user_annotation", labels) == "other"
    assert kind("Event Sync", True, "cuda_sync", labels) == "other"
    assert kind("ampere_gemm", True, "ActivityType.CONCURRENT_KERNEL", labels) == "kernel"  # an enum's name
    assert kind("cuLaunchKernel", False, "cuda_driver", labels) == "launch"
    assert kind("ampere_gemm", True, None, labels) == "kernel"  # a torch without activity types
    assert kind("Memset (Device)", True, None, labels) == "memset"
    assert kind("cudaLaunchKernel", False, "cuda_runtime", labels) == "launch"
    assert kind("forkrl.head", False, "user_annotation", labels) == "label"
    assert kind("aten::mm", False, "cpu_op", labels) == "op"


def test_the_7b_shape_is_cut_to_fit_an_h100_and_says_why(gpu):
    s = gpu.shapes
    full = s.SHAPES["7b"][0]
    h100 = s.plan_layers(full, s.METHODS, 2, 81559 * 2**20)
    assert 8 <= h100["layers"] < 28 and "layers cut from 28" in h100["cut"]
    assert max(h100["predicted_gib"].values()) <= s.MEMORY_SHARE * 81559 / 1024
    assert s.plan_layers(full, s.METHODS, 2, 400 * 2**30)["cut"] is None
    # the 0.5B shapes fit whole
    for name in ("0.5b", "math"):
        assert s.plan_layers(s.SHAPES[name][0], s.METHODS, 2, 81559 * 2**20)["cut"] is None
    # Qwen2.5-7B's parameter count (7.62B) and 0.5B's (0.49B) from the widths
    assert s.QWEN_7B.params() == pytest.approx(7.62e9, rel=0.01)
    assert s.QWEN_05B.params() == pytest.approx(0.494e9, rel=0.01)


def test_shape_constants_are_the_defaults_they_stand_for(gpu):
    import inspect

    from forkrl.core import TreeExecutor
    from forkrl.core.train import DEFAULT_BLOCK_SIZE

    s = gpu.shapes
    assert s.REPLAY_BLOCK == DEFAULT_BLOCK_SIZE
    leaf = inspect.signature(TreeExecutor).parameters.get("leaf_batch_tokens")
    assert leaf is None or leaf.default == s.LEAF_BATCH_TOKENS


def test_carried_wheels_are_appended_to_the_path(gpu, tmp_path):
    wheel = tmp_path / "gpucheck_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("gpucheck_probe/__init__.py", "VALUE = 7\n")
        z.writestr(
            "gpucheck_probe-1.0.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: gpucheck-probe\nVersion: 1.0\n",
        )
    (tmp_path / "native-1.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"")
    before = list(sys.path)
    try:
        got = gpu.wheels.put_on_path(tmp_path)
        assert sys.path[:-1] == before and sys.path[-1] == got["site"]  # appended, never first
        assert got["refused"] == ["native-1.0-cp312-cp312-manylinux_2_17_x86_64.whl"]
        import gpucheck_probe

        assert gpucheck_probe.VALUE == 7
        assert gpu.wheels.versions("gpucheck-probe", "no-such-dist") == {
            "gpucheck-probe": "1.0",
            "no-such-dist": None,
        }
    finally:
        sys.path[:] = before
        sys.modules.pop("gpucheck_probe", None)
    assert gpu.wheels.put_on_path(tmp_path / "absent") == {"folder": str(tmp_path / "absent"), "wheels": []}


def test_a_stage_timeout_is_not_taken_for_the_code_s_own_failure():
    """Library code under check catches Exception broadly (forkrl's first-use probe falls back on any
    failure); the budget's alarm must still end the stage, not be read as that code's failure."""
    gpu_check = _load("gpu_check", REPO / "scripts" / "gpu_check.py")

    def probe_that_swallows_failures() -> str:
        try:
            time.sleep(2)
        except Exception:  # noqa: BLE001 - as the probe does
            return "fell back"
        return "finished"

    try:
        with gpu_check._alarm(0.2):
            result = probe_that_swallows_failures()
    except gpu_check.StageTimeout:
        result = "timed out"
    assert result == "timed out"


@pytest.mark.slow
def test_gpu_check_reports_a_failing_stage(tmp_path):
    """A stage's error is a result (written, exit status 1), not a crash that loses the others."""
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/gpu_check.py",
            "--out",
            str(tmp_path),
            *"--device meta --stages env,ops".split(),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    stages = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]
    assert stages["env"]["status"] == "ok"
    assert stages["ops"]["status"] in ("error", "skipped")
    assert proc.returncode == (1 if stages["ops"]["status"] == "error" else 0)
