"""The README's main job keeps running: the example script end to end on a very small setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tree_training_example_runs_and_matches_dense():
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "tree_training.py"),
        "--steps", "2", "--prompts", "2", "--group", "3", "--prompt-len", "40", "--max-new", "6",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    log = out.stderr + out.stdout
    assert "step  1" in log and "reward: first step" in log
    # The first step compares the tree gradient with the plain one (float32).
    diff = float(log.split("max relative gradient difference ")[1].split()[0])
    assert diff < 1e-4
