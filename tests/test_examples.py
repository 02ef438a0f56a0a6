"""The README's main job keeps running: the example scripts end to end on a very small setting.

The example scripts and the README's snippet run two at a time (:func:`examples`, started by the first
of their tests): each is one process that keeps about one of the two cores busy (a tiny model's steps)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the examples end to end

ROOT = Path(__file__).resolve().parents[1]


#: The example scripts' tests: (script, its arguments, timeout in seconds); each also writes --summary.
EXAMPLES = {
    "test_tree_training_example_runs_and_matches_dense": (
        "tree_training.py",
        "--steps 2 --prompts 2 --group 4 --prompt-len 40 --max-new 16 --vocab 16".split(),
        300,
    ),
    "test_trl_grpo_tree_example_runs": (
        "trl_grpo_tree.py",
        "--steps 4 --compare-steps 2 --doc-len 64 --prompts 1 --group 4 --max-new 6".split(),
        600,
    ),
}


def _example(script: str, args: list[str], timeout: int, summary: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "examples" / script), *args, "--summary", str(summary)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def examples(request, tmp_path_factory):
    """The selected tests' scripts, two at a time: test name to (future, summary path or None)."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = {}
        for name, (script, args, timeout) in EXAMPLES.items():
            if name in selected:
                summary = tmp_path_factory.mktemp(name[5:25]) / "summary.json"
                started[name] = (pool.submit(_example, script, args, timeout, summary), summary)
        readme = "test_readme_trl_snippet_runs_on_a_cpu_machine_as_written"
        if readme in selected:
            started[readme] = (pool.submit(_readme_snippet, tmp_path_factory.mktemp("readme")), None)
        yield started
        for future, _ in started.values():
            future.cancel()  # those not started when the session stops early (-x)


def test_tree_training_example_runs_and_matches_dense(examples, request):
    future, summary = examples[request.node.name]
    out = future.result()
    assert out.returncode == 0, out.stderr[-2000:]
    log = out.stderr + out.stdout
    assert "step  1" in log and "reward: first step" in log
    # The first step compares the tree with plain per-sequence training (float32): the forest shares
    # each group's prompt, and the log-probs and the gradient agree.
    step0 = json.loads(summary.read_text())["step0"]
    assert step0["compression"] > 1.5  # 2 groups of 4 sharing a 40-token prompt: 2.16x
    assert step0["logprob_max_abs_diff"] < 1e-4
    assert step0["grad_max_rel_diff"] < 1e-4
    tree_norm, plain_norm = step0["grad_norm_tree"], step0["grad_norm_plain"]
    assert tree_norm > 0 and abs(tree_norm - plain_norm) <= 1e-4 * plain_norm  # a real gradient, the same
    assert step0["backward_tree_s"] > 0 and step0["backward_plain_s"] > 0


def test_trl_grpo_tree_example_runs(examples, request):
    """The README's main job: TRL GRPO with tree_packing vs stock TRL, on a very small setting."""
    future, summary = examples[request.node.name]
    out = future.result()
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stderr + out.stdout
    assert "time per optimizer step" in log and "tree_packing" in log
    assert "reward: first steps" in log
    compression = json.loads(summary.read_text())["steps"][0]["tree/compression"]
    assert compression > 1.0
    # The main job's output is its own summary: no library warnings, progress bars or log dicts.
    for noise in ("Warning", "it/s]", "Loading weights", "{'loss'"):
        assert noise not in log, f"{noise!r} in the example's output:\n{log[-2000:]}"


def _readme_snippet(folder: Path) -> tuple[str, subprocess.CompletedProcess]:
    """The README's TRL snippet and its run, with a local tiny model for the hub name and one step."""
    from forkrl.core.testing.models import byte_llama, byte_tokenizer, save_pretrained

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Using it in TRL", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    path = save_pretrained(byte_llama(0), byte_tokenizer(), folder / "model")
    code = snippet.replace('"Qwen/Qwen2.5-0.5B-Instruct"', repr(path)).replace(
        'output_dir="out",', f'output_dir={str(folder / "out")!r}, max_steps=1, report_to="none",'
    )
    script = folder / "snippet.py"
    script.write_text(code + "\nassert any('tree/compression' in h for h in trainer.state.log_history)\n")
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env={**os.environ, **env}
    )
    return snippet, out


def test_readme_trl_snippet_runs_on_a_cpu_machine_as_written(examples, request):
    """The README's TRL snippet, with a local tiny model for the hub name and one step: it runs on
    a machine without a GPU as written (TRL's bf16=True default, use_cpu=True)."""
    future, _ = examples[request.node.name]
    snippet, out = future.result()
    assert 'GRPOTrainer("Qwen/Qwen2.5-0.5B-Instruct"' in snippet and "use_cpu=True" in snippet
    assert out.returncode == 0, out.stderr[-3000:]
