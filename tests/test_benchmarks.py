"""The benchmarks keep running (``python -m benchmarks.NAME`` from the repo root) on tiny settings:
each prints its table, then one line of JSON whose figures are sane. Timings are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each benchmark end to end

ROOT = Path(__file__).resolve().parents[1]


def _run(name: str, *args: str) -> dict:
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("|") for line in lines), out.stdout[-2000:]  # the table
    return json.loads(lines[-1])


def test_tree_training_benchmark():
    res = _run("tree_training", "--models", "tiny", "--P", "128", "--G", "2", "--R", "16")
    (row,) = res["rows"]
    assert res["benchmark"] == "tree_training" and row["ideal_token_ratio"] == 1.8
    for method in ("dense", "keep", "replay", "packed"):
        assert row[f"{method}_s"] > 0 and row[f"{method}_saved_mb"] > 0


def test_long_context_benchmark():
    res = _run(
        "long_context",
        "--P",
        "1024",
        "--G",
        "2",
        "--R",
        "32",
        "--methods",
        "exact,none",
        "--block-size",
        "256",
    )
    assert res["benchmark"] == "long_context"
    assert [r["method"] for r in res["rows"]] == ["exact", "none"] and not any(
        r.get("failed") for r in res["rows"]
    )


@pytest.mark.parametrize("extra", [[], ["--gradient-checkpointing"]], ids=["default", "checkpointing"])
def test_trl_step_benchmark(extra):
    res = _run("trl_step", "--model", "tiny", "--P", "64", "--R", "16", "--G", "4", "--steps", "1", *extra)
    assert res["benchmark"] == "trl_step" and res["grad_agreement"] < 1e-4


def test_launch_budget_benchmark():
    res = _run("launch_budget", "--layers", "2", "--shapes", "one")
    rows = {r["method"]: r for r in res["rows"]}
    tree = ("keep", "keep-depth-first", "replay", "packed")
    assert set(rows) == {"dense", *tree}
    assert all(rows[m]["syncs"] == 0 and rows[m]["decoder_runs"] >= 1 for m in tree)


def test_balance_sim_benchmark():
    res = _run("balance_sim", "--ranks", "8", "--shapes", "grpo,multiturn", "--groups-per-rank", "2")
    assert res["benchmark"] == "balance_sim" and len(res["rows"]) == 2
    for row in res["rows"]:
        assert 1.0 <= row["tree"] <= row["length"] and row["tree_vs_length"] < 1.0


def test_balance_fit_benchmark():
    res = _run("balance_fit", "--model", "micro", "--reps", "1")
    assert res["benchmark"] == "balance_fit" and len(res["rows"]) == 12
    assert all(v >= 0 for v in res["fit"].values()) and res["held_out_abs_error_max"] >= 0


def test_tree_training_plot(tmp_path):
    png = tmp_path / "speedup.png"
    args = "--models micro --P 32,64 --G 2,3 --R 8 --methods dense,keep --no-score".split()
    res = _run("tree_training", *args, "--plot", str(png))
    assert len(res["rows"]) == 4 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_balance_run_benchmark():
    """Two real gloo ranks, with and without the balancer: the same gradients, the plan balanced."""
    args = "--model micro --reps 1 --P-long 128 --P-short 16 --G 2 --R 16".split()
    res = _run("balance_run", *args)
    assert res["benchmark"] == "balance_run" and res["grad_agreement"] < 1e-5
    (r0, r1) = res["ranks"]
    assert sorted(r0["rows_balanced"] + r1["rows_balanced"]) == list(range(8))
    assert max(r0["predicted_balanced"]) < max(r0["predicted_unbalanced"])


def test_moe_router_benchmark():
    res = _run("moe_router", "--size", "micro", "--P", "64", "--G", "4", "--R", "16", "--repeat", "1")
    (row,) = res["rows"]
    assert res["benchmark"] == "moe_router" and row["compression"] == 2.5
    for method in ("dense", "tree", "tree_scored", "tree_noaux"):
        assert row[f"{method}_s"] > 0


def test_sharded_comm_benchmark():
    res = _run("sharded_comm", "--model", "micro", "--P", "32", "--G", "2", "--R", "8")
    tree, stock = (next(r for r in res["rows"] if r["path"] == p) for p in ("tree", "stock-sync-last"))
    assert res["ranks_agree"]
    # One gather and one reduce-scatter of the whole model per step, whatever the micro-batches.
    assert abs(tree["over_model"] - 2.0) < 0.01 and tree["total_mib"] < stock["total_mib"]


def test_learning_curve_benchmark():
    res = _run(
        "learning_curve", "--steps", "2", "--doc-len", "32", "--group", "4", "--max-new", "4", "--plot", ""
    )
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


def test_vlm_tree_benchmark():
    res = _run(
        "vlm_tree",
        "--size",
        "micro",
        "--image-tokens",
        "16",
        "--P",
        "8",
        "--G",
        "2",
        "--R",
        "8",
        "--repeat",
        "1",
    )
    (row,) = res["rows"]
    assert res["benchmark"] == "vlm_tree" and row["compression"] > 1 and row["ideal_flop_ratio"] > 1
    assert row["dense_s"] > 0 and row["tree_s"] > 0 and row["tree_saved_mb"] < row["dense_saved_mb"]
