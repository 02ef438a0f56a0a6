"""The benchmarks keep running (``python -m benchmarks.NAME`` from the repo root) on tiny settings:
each prints its table, then one line of JSON whose figures are sane. Timings are not asserted.

Most of these benchmarks keep one core busy (tiny tensors: their time is Python and imports; measured
on 2 cores, tree_training, long_context and trl_step at 1.0-1.1 cores), so the one-process benchmarks
run two at a time (:func:`started`: the selected tests' commands, started with the first of them);
the two-rank ones (two processes already) run alone after those."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each benchmark end to end

ROOT = Path(__file__).resolve().parents[1]
PLOT = "speedup.png"
TRL_STEP = ("trl_step", "--model", "tiny", "--P", "64", "--R", "16", "--G", "4", "--steps", "1")

#: The one-process benchmarks' arguments, by the test that checks them.
BENCHMARKS = {
    "test_tree_training_benchmark": ("tree_training", "--models", "tiny", "--P", "128", "--G", "2", "--R", "16"),
    "test_long_context_benchmark": (
        "long_context", "--P", "1024", "--G", "2", "--R", "32", "--methods", "exact,none", "--block-size", "256",
    ),
    "test_trl_step_benchmark[default]": TRL_STEP,
    "test_trl_step_benchmark[checkpointing]": (*TRL_STEP, "--gradient-checkpointing"),
    "test_launch_budget_benchmark": ("launch_budget", "--layers", "2", "--shapes", "one"),
    "test_balance_sim_benchmark": ("balance_sim", "--ranks", "8", "--shapes", "grpo,multiturn", "--groups-per-rank", "2"),
    "test_balance_fit_benchmark": ("balance_fit", "--model", "micro", "--reps", "1"),
    "test_tree_training_plot": (
        "tree_training", *"--models micro --P 32,64 --G 2,3 --R 8 --methods dense,keep --no-score".split(), "--plot", PLOT,
    ),
    "test_moe_router_benchmark": ("moe_router", "--size", "micro", "--P", "64", "--G", "4", "--R", "16", "--repeat", "1"),
    "test_learning_curve_benchmark": (
        "learning_curve", "--steps", "2", "--doc-len", "32", "--group", "4", "--max-new", "4", "--plot", "",
    ),
    "test_vlm_tree_benchmark": (
        "vlm_tree", "--size", "micro", "--image-tokens", "16", "--P", "8", "--G", "2", "--R", "8", "--repeat", "1",
    ),
}  # fmt: skip


def _process(name: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


def _result(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("|") for line in lines), out.stdout[-2000:]  # the table
    return json.loads(lines[-1])


def _run(name: str, *args: str) -> dict:
    """A benchmark run in this test (the two-rank ones, :func:`alone`)."""
    return _result(_process(name, *args))


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """The selected tests' one-process benchmarks, two at a time from the first test on: the test's
    name to its process's future, and the folder its ``--plot`` file goes to."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    folder = tmp_path_factory.mktemp("benchmarks")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {
            test: pool.submit(_process, *(str(folder / PLOT) if a == PLOT else a for a in args))
            for test, args in BENCHMARKS.items()
            if test in selected
        }
        yield futures, folder
        for future in futures.values():
            future.cancel()  # those not started when the session stops early (-x)


@pytest.fixture
def benchmark(started, request) -> dict:
    """This test's benchmark result (its process started by :func:`started`)."""
    return _result(started[0][request.node.name].result())


@pytest.fixture
def alone(started) -> None:
    """Every started benchmark done: a two-rank benchmark then runs alone."""
    concurrent.futures.wait(started[0].values())


def test_tree_training_benchmark(benchmark):
    res = benchmark
    (row,) = res["rows"]
    assert res["benchmark"] == "tree_training" and row["ideal_token_ratio"] == 1.8
    for method in ("dense", "keep", "replay", "packed"):
        assert row[f"{method}_s"] > 0 and row[f"{method}_saved_mb"] > 0


def test_long_context_benchmark(benchmark):
    res = benchmark
    assert res["benchmark"] == "long_context"
    assert [r["method"] for r in res["rows"]] == ["exact", "none"] and not any(
        r.get("failed") for r in res["rows"]
    )


@pytest.mark.parametrize("checkpointing", ["default", "checkpointing"])  # BENCHMARKS' two runs
def test_trl_step_benchmark(checkpointing, benchmark):
    res = benchmark
    assert res["benchmark"] == "trl_step" and res["grad_agreement"] < 1e-4


def test_launch_budget_benchmark(benchmark):
    res = benchmark
    rows = {r["method"]: r for r in res["rows"]}
    tree = ("keep", "keep-depth-first", "replay", "packed")
    assert set(rows) == {"dense", *tree}
    assert all(rows[m]["syncs"] == 0 and rows[m]["decoder_runs"] >= 1 for m in tree)


def test_balance_sim_benchmark(benchmark):
    res = benchmark
    assert res["benchmark"] == "balance_sim" and len(res["rows"]) == 2
    for row in res["rows"]:
        assert 1.0 <= row["tree"] <= row["length"] and row["tree_vs_length"] < 1.0


def test_balance_fit_benchmark(benchmark):
    res = benchmark
    assert res["benchmark"] == "balance_fit" and len(res["rows"]) == 12
    assert all(v >= 0 for v in res["fit"].values()) and res["held_out_abs_error_max"] >= 0


def test_tree_training_plot(benchmark, started):
    png = started[1] / PLOT
    res = benchmark
    assert len(res["rows"]) == 4 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_balance_run_benchmark(alone):
    """Two real gloo ranks, with and without the balancer: the same gradients, the plan balanced."""
    args = "--model micro --reps 1 --P-long 128 --P-short 16 --G 2 --R 16".split()
    res = _run("balance_run", *args)
    assert res["benchmark"] == "balance_run" and res["grad_agreement"] < 1e-5
    (r0, r1) = res["ranks"]
    assert sorted(r0["rows_balanced"] + r1["rows_balanced"]) == list(range(8))
    assert max(r0["predicted_balanced"]) < max(r0["predicted_unbalanced"])


def test_moe_router_benchmark(benchmark):
    res = benchmark
    (row,) = res["rows"]
    assert res["benchmark"] == "moe_router" and row["compression"] == 2.5
    for method in ("dense", "tree", "tree_scored", "tree_noaux"):
        assert row[f"{method}_s"] > 0


def test_sharded_comm_benchmark(alone):
    res = _run("sharded_comm", "--model", "micro", "--P", "32", "--G", "2", "--R", "8")
    tree, stock = (next(r for r in res["rows"] if r["path"] == p) for p in ("tree", "stock-sync-last"))
    assert res["ranks_agree"]
    # One gather and one reduce-scatter of the whole model per step, whatever the micro-batches.
    assert abs(tree["over_model"] - 2.0) < 0.01 and tree["total_mib"] < stock["total_mib"]


def test_learning_curve_benchmark(benchmark):
    res = benchmark
    s = res["summary"]
    assert len(res["rows"]) == 2 and s["greedy_agree"] in (True, False)
    # Same seed, same weights: the first step's rollouts are TRL's own sampling in both runs.
    assert res["rows"][0]["same_rollouts"] and s["identical_steps"] >= 1


def test_learning_curve_report_compares_against_the_rounding_control(tmp_path, capsys):
    """The hosts' report (``--host verl|openrlhf``, whose runs need the hosts' launchers): the gap
    between stock and tree, and the control's (stock changed by rounding alone) beside it; the
    printed JSON line replots without rerunning."""
    from types import SimpleNamespace

    from benchmarks.learning_curve import main, report

    def run(rewards, rollouts, greedy):
        return {"rewards": rewards, "seconds": [2.0 * (k + 1) for k in range(len(rewards))],
                "rollouts": dict(enumerate(rollouts)), "greedy": greedy}  # fmt: skip

    runs = {
        "stock": run([0.1, 0.2, 0.5, 0.6, 0.6, 0.6], ["a", "b", "c", "d", "e", "f"], [[1, 2]]),
        "tree": run([0.1, 0.2, 0.4, 0.6, 0.6, 0.6], ["a", "b", "x", "d", "e", "f"], [[1, 2]]),
        "control": run([0.1, 0.3, 0.5, 0.6, 0.6, 0.6], ["a", "y", "c", "d", "e", "f"], [[1, 3]]),
    }
    runs["tree"]["seconds"] = [1.0 * (k + 1) for k in range(6)]
    args = SimpleNamespace(group=8, prompts=2, seed=0, plot="")
    out = report(args, runs, "title")
    s = out["summary"]
    assert s["first_step_rollouts_differ"] == 3 and s["identical_steps"] == 2
    assert s["max_reward_gap"] == pytest.approx(0.1) and s["max_reward_gap_while_identical"] == 0.0
    assert s["time_to_reward_ratio"] == pytest.approx(2.0) and s["greedy_agree"]
    c = s["control"]
    assert c["first_step_rollouts_differ"] == 2 and c["max_reward_gap"] == pytest.approx(0.1)
    assert not c["greedy_agree_with_stock"]
    record = tmp_path / "curve.json"
    record.write_text(json.dumps({"host": "verl", **out}))
    png = tmp_path / "curve.png"
    sys.argv = ["learning_curve", "--replot", str(record), "--plot", str(png)]
    main()
    assert png.stat().st_size > 1000


def test_vlm_tree_benchmark(benchmark):
    res = benchmark
    (row,) = res["rows"]
    assert res["benchmark"] == "vlm_tree" and row["compression"] > 1 and row["ideal_flop_ratio"] > 1
    assert row["dense_s"] > 0 and row["tree_s"] > 0 and row["tree_saved_mb"] < row["dense_saved_mb"]
