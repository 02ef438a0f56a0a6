"""``python -m forkrl estimate``: reads a user's prompts the ways hosts store them, prices the forest,
picks the mode as ``tree_mode="auto"`` would, refuses bad input clearly, and its predicted speedup
holds against measured steps (``benchmarks.estimate_check``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from forkrl.__main__ import main
from forkrl.core.testing.models import byte_llama, byte_tokenizer, save_pretrained

ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
WORDS = ("tree", "prefix", "token", "group", "cache", "branch")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The README example's tiny model and byte tokenizer (examples/trl_grpo_tree.py)."""
    path = tmp_path_factory.mktemp("model")
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = byte_llama(0, hidden_size=64, intermediate_size=172, max_position_embeddings=8192)
    return save_pretrained(model, tokenizer, path)


def _prompts(n: int) -> list[str]:
    doc = " ".join(WORDS[i % len(WORDS)] for i in range(60))
    return [f"{doc} question {i}: which letters?" for i in range(n)]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _estimate(capsys, *argv: str) -> dict:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.timing  # --price fit times the model on calibration shapes
def test_a_thousand_text_prompts_with_the_examples_model(model_dir, tmp_path, capsys):
    data = _jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in _prompts(1000)])
    est = _estimate(capsys, "--model", model_dir, "--dataset", data, "-G", "8", "-R", "32", "--price", "fit")
    assert est["prompts"] == 1000 and est["steps"] == 125 and est["group_size"] == 8
    # Each group shares its prompt, and the 8 prompts of a step share the document: more than the
    # groups alone would give, G * (P + R) / (P + G * R).
    P, G, R = est["prompt_tokens_median"], 8, 32
    assert est["compression"] > 1.5 * G * (P + R) / (P + G * R)
    assert set(est["modes"]) == {"keep", "replay", "packed"}
    assert est["modes"]["keep"]["train_speedup"] > 1.5  # a long shared prompt: the tree is faster
    assert est["modes"]["replay"]["cache_bytes"] > 0 and est["stock"]["train_speedup"] == 1.0
    # TRL's gradient checkpointing is on by default: auto replays, and says so.
    assert est["pick"] == "replay" and "gradient checkpointing" in est["reason"]


def test_the_compression_of_token_id_prompts_is_exact(model_dir, tmp_path, capsys):
    """Prompts given as token ids, nothing shared across them: synthetic completions share only
    their group's prompt, so the compression is G * (P + R) / (P + G * R) exactly."""
    rows = [{"prompt_ids": [i] + [7] * 99} for i in range(12)]
    data = _jsonl(tmp_path / "ids.jsonl", rows)
    est = _estimate(
        capsys, "--model", model_dir, "--dataset", data, "-G", "4", "-R", "20", "--price", "config"
    )
    assert est["compression"] == pytest.approx(4 * 120 / (100 + 4 * 20), rel=1e-12)
    assert est["prompt_tokens_median"] == 100 and est["completion_tokens_median"] == 20


def test_host_conventions_chat_messages_parquet_and_a_saved_dataset(model_dir, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    chats = [{"input": [{"role": "user", "content": p}]} for p in _prompts(20)]
    datasets.Dataset.from_list(chats).to_parquet(tmp_path / "p.parquet")
    datasets.Dataset.from_list(chats).save_to_disk(tmp_path / "saved")
    common = ["--model", model_dir, "-G", "4", "-R", "16", "--host", "openrlhf", "--price", "config"]
    a = _estimate(capsys, *common, "--dataset", str(tmp_path / "p.parquet"))
    b = _estimate(capsys, *common, "--dataset", str(tmp_path / "saved"))
    assert a["compression"] == b["compression"] > 1
    # OpenRLHF's default: no gradient checkpointing, so auto keeps; it scores old and reference log-probs.
    assert a["pick"] == "keep" and a["score_passes"] == 2
    # Priced from FLOPs, every tree mode costs the same: the speedup is the ideal FLOP ratio.
    assert a["modes"]["keep"]["train_speedup"] == pytest.approx(a["ideal_flop_ratio"])
    assert "FLOPs" in a["pricing"]


def test_logged_rollouts_count_the_completions_shared_openings(model_dir, tmp_path, capsys):
    prompts = _prompts(4)
    rollouts = [
        {"prompt": p, "completion": f"Let me think step by step about {k}"} for p in prompts for k in range(4)
    ]
    data = _jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in prompts])
    logged = _jsonl(tmp_path / "r.jsonl", rollouts)
    common = ["--model", model_dir, "--dataset", data, "-G", "4", "-R", "34", "--price", "config"]
    synthetic = _estimate(capsys, *common)
    real = _estimate(capsys, *common, "--rollouts", logged)
    assert real["logged"] and real["group_size"] == 4
    assert real["compression"] > synthetic["compression"]  # "Let me think step by step about " is shared


@pytest.mark.parametrize(
    ("rows", "extra", "message"),
    [
        ([{"question": "hi"}], [], "no prompt: expected one of the columns prompt_ids, input_ids, prompt"),
        ([{"prompt": "hi"}], ["-G", "0"], "--num-generations must be >= 1"),
        ([{"prompt": ""}], [], "the prompt is empty"),
        ([{"prompt": [{"role": "user", "content": "hi"}]}], ["--tokenizer", "BYTES"], "has no chat template"),
    ],
)
def test_bad_input_is_a_clear_error(model_dir, tmp_path, rows, extra, message):
    data = _jsonl(tmp_path / "p.jsonl", rows)
    if "BYTES" in extra:  # a tokenizer without a chat template
        plain = save_pretrained(
            byte_llama(0, hidden_size=32, intermediate_size=64), byte_tokenizer(), tmp_path / "t"
        )
        extra = [plain if a == "BYTES" else a for a in extra]
    argv = [
        "estimate",
        "--model",
        model_dir,
        "--dataset",
        data,
        "-G",
        "4",
        "-R",
        "8",
        "--price",
        "config",
        *extra,
    ]
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_a_missing_file_and_text_without_a_tokenizer(tmp_path):
    config_only = tmp_path / "config"
    byte_llama(0, hidden_size=32, intermediate_size=64).config.save_pretrained(config_only)
    argv = ["estimate", "--model", str(config_only), "-G", "2", "-R", "4", "--price", "config", "--dataset"]
    with pytest.raises(SystemExit, match="no such file"):
        main([*argv, str(tmp_path / "missing.jsonl")])
    with pytest.raises(SystemExit, match="is text: give --tokenizer"):
        main([*argv, _jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])])


@pytest.mark.timing
def test_the_predicted_speedup_holds_within_25_percent_of_measured_steps():
    """Three shapes the fit never timed: keep's predicted speedup against benchmarks.tree_training's
    measured one (dense and keep side by side, the mean of two runs each)."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.estimate_check", "--repeat", "2"],  # CI time; worst seen 12%
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["rows"]) == 3
    assert proc.returncode == 0 and result["worst_error"] <= 0.25, proc.stdout[-3000:]
