"""``speculative_rollout`` with ``use_vllm=True`` on TRL's side (this environment has TRL, not vLLM).

What runs here: the config rules, the colocated ``LLM(...)`` call TRL makes receiving forkrl's
speculative config (TRL's module global swapped for the duration of the trainer's construction),
the server command TRL's own ``build_command`` turns it into, and the ``spec/*`` figures read
from vLLM's counters (its Prometheus text and ``get_metrics`` objects, by name). The drafter's
re-sync inside vLLM is tested against real vLLM in ``tests/openrlhf/test_vllm_drafter.py``.
"""

from __future__ import annotations

import json
import os
import types

import pytest

from forkrl.core.speculative import SpeculativeOptions

pytest.importorskip("trl")

import trl.generation.vllm_generation as vg  # noqa: E402
from trl.scripts.vllm_serve import build_command  # noqa: E402

from forkrl.plugins import trl as ftrl  # noqa: E402
from forkrl.plugins.trl import compat, vllm_serve, vllm_speculative  # noqa: E402

from .trl_helpers import base_args, prompt_dataset, save_tiny_llama  # noqa: E402


def _config(tmp_path, **kw):
    return ftrl.GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", use_vllm=True, speculative_rollout=True,
        speculative_policy="always", **kw,
    )  # fmt: skip


def test_config_accepts_vllm_with_a_fixed_draft_length(tmp_path):
    config = _config(tmp_path, speculative_draft_len=5, speculative_bits=8)
    assert config.use_vllm and config.speculative_draft_len == 5
    with pytest.raises(ValueError, match="min_p"):  # the sampling rules stay
        _config(tmp_path, min_p=0.1)


def test_colocated_llm_gets_forkrl_speculative_config(tmp_path, monkeypatch):
    """The keyword arguments TRL's _init_vllm passes reach LLM with forkrl's two added, for TRL's model and TP."""
    calls = []
    monkeypatch.setattr(vg, "LLM", lambda *a, **kw: calls.append(kw) or "engine", raising=False)
    original = vg.LLM
    config = _config(tmp_path, speculative_draft_len=3, speculative_group_size=64)
    with compat.vllm_engine_kwargs(vllm_speculative.colocate_engine_kwargs(config, lambda: None)):
        assert vg.LLM(model="org/policy", tensor_parallel_size=2, seed=0) == "engine"
    assert vg.LLM is original
    (kw,) = calls
    assert kw["seed"] == 0 and kw["disable_log_stats"] is False
    assert kw["speculative_config"] == {
        "method": "draft_model", "model": "org/policy", "num_speculative_tokens": 3,
        "quantization": "forkrl_int4_g64", "draft_tensor_parallel_size": 2, "draft_sample_method": "probabilistic",
    }  # fmt: skip


@pytest.fixture
def colocated_engines(monkeypatch):
    """TRL's real trainer and VLLMGeneration, with vLLM's LLM class recorded instead of started (no vLLM here)."""
    calls = []

    class RecordedLLM:
        def __init__(self, *args, **kwargs):
            calls.append(kwargs)

    monkeypatch.setattr(vg, "LLM", RecordedLLM, raising=False)
    monkeypatch.setattr(vg, "is_vllm_available", lambda *a, **k: True)
    # TRL's colocate setup exports these for vLLM's launcher: restore them, or later tests' processes inherit a rank.
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {n: os.environ.get(n) for n in names}
    yield calls
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _trainer(tmp_path, **spec):
    model = save_tiny_llama(tmp_path / "model")
    args = base_args(tmp_path / "out", max_completion_length=10)
    config = ftrl.GRPOConfig(
        **args, use_vllm=True, speculative_rollout=True, speculative_group_size=32, **spec
    )
    reward = lambda completion_ids, **_: [0.0] * len(completion_ids)  # noqa: E731
    return ftrl.GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=prompt_dataset())


def test_trainer_builds_trls_engine_with_the_drafter(tmp_path, colocated_engines):
    trainer = _trainer(tmp_path, speculative_policy="always", speculative_draft_len=4)
    (kw,) = colocated_engines
    assert kw["speculative_config"] == {
        "method": "draft_model", "model": kw["model"], "num_speculative_tokens": 4, "quantization": "forkrl_int4_g32",
        "draft_tensor_parallel_size": 1, "draft_sample_method": "probabilistic",
    }  # fmt: skip
    assert kw["disable_log_stats"] is False and kw["distributed_executor_backend"] == "external_launcher"
    assert trainer.forkrl_spec.rollout is None  # vLLM generates; forkrl's transformers sampler is not built
    assert vg.LLM.__name__ == "RecordedLLM"  # the swap lasted only while the trainer was built


def test_auto_policy_hands_vllm_a_draft_length_per_batch_size(tmp_path, colocated_engines, monkeypatch):
    seen = []

    def schedule(config, model, max_batch):
        seen.append((type(model).__name__, max_batch))
        return [(1, 4, 3), (5, max_batch, 0)]

    monkeypatch.setattr(vllm_speculative, "calibrated_schedule", schedule)
    _trainer(tmp_path)
    (kw,) = colocated_engines
    assert seen == [("LlamaForCausalLM", kw["max_num_seqs"])]
    spec = kw["speculative_config"]
    assert spec["num_speculative_tokens"] == 3
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, kw["max_num_seqs"], 0]]


def test_auto_policy_calibrates_on_the_policy(tmp_path, colocated_engines):
    """The real calibration: the table covers every batch size TRL's engine can run, or, where drafting
    pays nowhere (a tiny model on a CPU), vLLM gets no speculative config at all."""
    _trainer(tmp_path)
    (kw,) = colocated_engines
    spec = kw.get("speculative_config")
    if spec is None:
        assert "disable_log_stats" not in kw
    else:
        table = spec["num_speculative_tokens_per_batch_size"]
        assert table[0][0] == 1 and table[-1][1] == kw["max_num_seqs"]
        assert spec["num_speculative_tokens"] == max(k for _, _, k in table) > 0


def test_no_rank_leaks_from_the_colocated_setup():
    assert "WORLD_SIZE" not in os.environ and "MASTER_PORT" not in os.environ


def test_engine_kwargs_swap_restores_a_missing_global(monkeypatch):
    monkeypatch.delattr(vg, "LLM", raising=False)
    with compat.vllm_engine_kwargs(lambda kw: {}):
        assert callable(vg.LLM)
    assert not hasattr(vg, "LLM")


def test_server_command_carries_the_drafter(tmp_path):
    """forkrl's server entry: TRL's parser and TRL's build_command, with forkrl's speculative config."""
    script_args, extra = vllm_serve.server_command(
        ["--model", "org/policy", "--tensor_parallel_size", "2", "--forkrl.speculative_draft_len", "6",
         "--forkrl.speculative_bits", "8", "--max-num-seqs", "16"]
    )  # fmt: skip
    spec = json.loads(script_args.speculative_config)
    assert spec == {
        "method": "draft_model", "model": "org/policy", "num_speculative_tokens": 6, "quantization": "forkrl_int8",
        "draft_tensor_parallel_size": 2, "draft_sample_method": "probabilistic",
    }  # fmt: skip
    command = build_command(script_args, extra)
    assert command[command.index("--speculative-config") + 1] == script_args.speculative_config
    assert "--max-num-seqs" in command
    with pytest.raises(SystemExit):
        vllm_serve.server_command(["--model", "m", "--forkrl.speculative_policy_x", "1"])
    with pytest.raises(SystemExit):
        vllm_serve.server_command(["--model", "m", "--speculative_config", "{}"])


def test_server_help_lists_forkrls_flags_then_trls(capsys):
    vllm_serve.main(["--help"])
    out = capsys.readouterr().out
    flat = "".join(out.split())  # argparse wraps lines, also after hyphens
    for name in ("speculative_bits", "speculative_group_size", "speculative_draft_len"):
        assert f"--forkrl.{name}" in out
        assert "".join(SpeculativeOptions.__dataclass_fields__[name].metadata["help"].split()) in flat
    assert "--forkrl.speculative_policy" not in out  # the server always speculates with a fixed length
    assert out.index("--forkrl.speculative_bits") < out.index("--tensor_parallel_size")


def test_server_without_vllm_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(SystemExit, match=r"vLLM is not installed .*pip install -e '\.\[vllm\]'"):
        vllm_serve.main(["--model", "org/policy", "--forkrl.speculative_draft_len", "4"])


PROMETHEUS = """
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0
vllm:prompt_tokens_total{engine="0"} 123.0
"""


def test_counters_from_the_server_and_the_colocated_engine():
    assert vllm_speculative.prometheus_counters(PROMETHEUS) == {
        "drafts": 10.0,
        "draft_tokens": 40.0,
        "accepted": 30.0,
    }
    metric = types.SimpleNamespace
    llm = types.SimpleNamespace(
        get_metrics=lambda: [
            metric(name="vllm:spec_decode_num_drafts", value=4),
            metric(name="other", value=1),
        ]
    )
    colocated = types.SimpleNamespace(mode="colocate", llm=llm)
    assert vllm_speculative.counters(colocated) == {"drafts": 4.0, "draft_tokens": 0.0, "accepted": 0.0}
    broken = types.SimpleNamespace(
        mode="server", vllm_client=types.SimpleNamespace(base_url="http://127.0.0.1:9")
    )
    assert vllm_speculative.counters(broken) is None  # unreachable server: no figures, no failure
