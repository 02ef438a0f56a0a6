"""Every causal LM architecture of the installed transformers is exact on a tree or refused with a
reason before any state changes (scripts/model_sweep.py): no crash, no silent mismatch, no hang, and
none that the sweep cannot build. The fast tests run a few architectures that need the sweep's
per-architecture table (scripts/model_sweep_configs.py) and its bf16 mode on the full float64 sweep."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds and steps every architecture

REPO = Path(__file__).resolve().parents[1]
BAD = ("crash", "mismatch", "timeout", "unbuildable", "fail")


def _sweep(*args: str, timeout: float = 600) -> dict[str, dict]:
    proc = subprocess.run(
        [sys.executable, "scripts/model_sweep.py", "--seconds", "60", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["model_type"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])["rows"]}


def test_table_names_real_architectures():
    """Every entry of the table is a model_type of transformers' causal-LM mapping (a typo would
    silently fall back to the generic sizes)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import model_sweep_configs as table
    finally:
        sys.path.remove(str(REPO / "scripts"))
    for entries in (table.OVERRIDES, table.AFTER_BUILD, table.NEEDS):
        assert set(entries) <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), set(entries) - set(
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        )
    assert not set(table.NEEDS) & set(table.OVERRIDES)  # a model that is not run needs no sizes


@pytest.fixture(scope="module")
def float64_sweep() -> dict[str, dict]:
    """The whole sweep in float64 (about two minutes of one core), once for the tests below: two
    sweeps of half the architectures each, side by side (each architecture's check is single-threaded
    Python and tiny tensors, so this takes about half the time on two cores)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        halves = pool.map(
            lambda part: _sweep("--only", ",".join(part), timeout=1800), (names[::2], names[1::2])
        )
        rows = {k: v for half in halves for k, v in half.items()}
    assert set(rows) == set(names)
    return rows


def test_table_builds_architectures_the_generic_sizes_miss(float64_sweep):
    """Fields the generic sizes miss (CodeGen's rotary width, dots1's shared experts), a composite
    config whose causal LM is its text model (Qwen3.5), a multimodal wrapper with shrunk sub-configs
    (Gemma 3), a build step (X-MOD's language): each builds and is exact or refused by the executor;
    a drafter that needs its target model's states is refused with that reason, not run."""
    names = ("llama", "codegen", "dots1", "qwen3_5", "gemma3", "xmod", "gemma4_assistant")
    rows = {k: float64_sweep[k] for k in names}
    assert {k: r["status"] for k, r in rows.items() if r["status"] in BAD} == {}
    for name in ("llama", "codegen", "dots1", "qwen3_5", "gemma3"):
        assert rows[name]["status"].startswith("exact"), rows[name]
        assert rows[name]["modes"]["keep"]["status"] == "exact"
    assert rows["xmod"]["status"] == "refused" and "modes" in rows["xmod"]  # run, then refused by the probe
    assert (
        rows["gemma4_assistant"]["status"] == "refused"
        and "shared_kv_states" in rows["gemma4_assistant"]["why"]
    )


def test_bf16_mode_runs_the_precision_criterion():
    """Under bf16 autocast and on bf16 weights the tree is a bf16 computation as accurate as stock
    (Bf16Rounding.check_follows(near=1.5) on all log-probs and all gradients), per mode. The two
    sweeps run side by side (one core each, as the float64 sweep's halves)."""
    precisions = ("bf16", "bf16-weights")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sweeps = pool.map(
            lambda precision: _sweep(
                "--only", "llama,qwen3_moe,lfm2" if precision == "bf16" else "llama", "--precision", precision
            ),
            precisions,
        )
        for precision, rows in zip(precisions, sweeps, strict=True):
            for name, row in rows.items():
                assert row["status"] == "pass", (precision, name, row)
                for mode in row["modes"].values():
                    assert 0.5 <= mode["grad_off"] <= 1.5 and mode["grad_near"] < 1.5, (precision, name, mode)


def test_every_architecture_is_exact_or_refused(float64_sweep):
    rows = list(float64_sweep.values())
    bad = [(r["class"], r["status"], r.get("modes") or r.get("why") or r.get("build_error")) for r in rows
           if r["status"] in BAD]  # fmt: skip
    assert not bad, bad
    assert all(r.get("why") or "modes" in r for r in rows if r["status"] == "refused")  # each with its reason
    exact = [r["class"] for r in rows if r["status"].startswith("exact")]
    # Architectures forkrl's own tests also build by hand (tests/core) are among the exact ones here.
    for name in (
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MistralForCausalLM",
        "Lfm2ForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        "GptOssForCausalLM",
        "BambaForCausalLM",
        "NemotronHForCausalLM",
        "FalconH1ForCausalLM",
        "Qwen3NextForCausalLM",
    ):
        assert name in exact, (name, exact)
    refused = {r["class"]: r for r in rows if r["status"] == "refused"}
    assert "BertLMHeadModel" in refused  # bidirectional: caught by the first-use probe, not trained wrong
