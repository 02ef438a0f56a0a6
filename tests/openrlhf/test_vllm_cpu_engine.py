"""forkrl's self-drafter through real vLLM engines on this CPU (vllm-cpu, the version OpenRLHF pins).

:mod:`tests.openrlhf.vllm_cpu_engine` runs the engines (one process, in turn) and writes what
they produced; here: with forkrl's int4 and int8 drafters vLLM's greedy output equals plain
decoding over prompts of different lengths with stop tokens, before and after each of two syncs
(vLLM's own ``reload_weights`` from a checkpoint, and the hosts' ``load_weights`` one tensor at a
time); its samples at temperature 1, with and without top-p, follow the same distribution as plain
sampling's (two-sample chi-square tests, with another policy's samples as the control that the
test can see a difference; vllm-cpu's own stand-in for one rejection-sampler kernel fails it,
forkrl's plugin replaces it); after each sync the drafter is bitwise forkrl's quantization of the
new weights (every layer) and the engine drafts and accepts exactly what an engine started from
the new weights does. The same run without forkrl's mirror drafts with the old weights: its counts
differ, so the check can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.openrlhf.vllm_cpu_engine import PROMPTS
from tests.stats import homogeneity_pvalue

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.openrlhf.vllm_cpu_engine", str(out), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("vllm_cpu"))


def test_vllm_serves_on_this_cpu_with_forkrls_plugin():
    from vllm.platforms import current_platform

    assert current_platform.is_cpu(), "this environment's vLLM is not the CPU build (scripts/setup.sh)"


def test_greedy_output_equals_plain_decoding_before_and_after_each_sync(run):
    assert run["mirror"]
    assert run["spec0"] == run["plain0"]
    assert run["spec1"] == run["plain1"] == run["fresh1"]  # after vLLM's reload_weights
    assert run["spec2"] == run["plain2"] == run["fresh2"]  # after the hosts' load_weights per tensor
    assert run["spec1"] != run["spec0"] and run["spec2"] != run["spec1"]  # each sync changed the policy
    lengths = {len(c) for c in run["plain0"] + run["plain1"]}
    assert min(lengths) < 24 and max(lengths) == 24  # some rows end at a stop token, others run on
    assert len({len(p) for p in PROMPTS}) == len(PROMPTS)
    for k in range(3):
        counts = run[f"spec{k}_counts"]
        assert counts["draft_tokens"] > 0 and 0 < counts["accepted"] < counts["draft_tokens"]


def test_an_int8_drafter_is_exact_and_the_quantized_policy(run):
    assert run["int8"] == run["plain0"]
    matches = run["int8_drafter_matches_w0"]
    assert len(matches) >= 14 and all(matches.values()), matches
    assert run["int8_counts"]["accepted"] > run["spec0_counts"]["accepted"] * 0.5


def _pvalues(a: list[list[int]], b: list[list[int]]) -> list[float]:
    """Homogeneity p-values of the first token, the first two and all three."""
    return [homogeneity_pvalue([x[:k] for x in a], [x[:k] for x in b]) for k in (1, 2, 3)]


@pytest.mark.parametrize("top_p", ["samples", "top_p"])
def test_samples_follow_the_policys_distribution(run, top_p):
    p_same = _pvalues(run[f"spec0_{top_p}"], run[f"plain0_{top_p}"])
    p_other = _pvalues(run[f"spec0_{top_p}"], run["plain1_samples"])
    assert min(p_same) > 1e-3, (p_same, p_other)
    assert min(p_other) < 1e-6, p_other  # the test sees a policy one noisy update away
    if top_p == "top_p":  # and sees what top-p removes
        assert min(_pvalues(run["spec0_top_p"], run["plain0_samples"])) < 1e-4


@pytest.mark.parametrize("sync", ["w1", "w2"])
def test_the_drafter_is_the_quantized_new_policy_after_each_sync(run, sync):
    matches = run[f"drafter_matches_{sync}"]
    assert len(matches) >= 14 and all(matches.values()), matches  # 2 layers x 4 linears + dense tensors
    k = sync[1]
    assert run[f"spec{k}_counts"] == run[f"fresh{k}_counts"]  # drafts exactly as if started from it


@pytest.fixture(scope="module")
def controls(tmp_path_factory) -> dict:
    """The same run without forkrl's mirror and with vllm-cpu's own ``expand_kernel`` stand-in (one
    run for both: greedy decoding never expands a temperature, and a stale drafter leaves exact
    sampling exact), its engines at W0 only (``--controls``): the plain and fresh engines at W1
    and W2 it is compared with are the first run's (neither flag reaches them; each is greedy, and
    vLLM's counts are the same in every process, as tests/trl_vllm compares them across processes)."""
    return _run(tmp_path_factory.mktemp("controls"), "--no-mirror", "--vllm-expand", "--controls")


@pytest.mark.parametrize("sync", ["w1", "w2"])
def test_without_the_mirror_the_drafter_is_stale(run, controls, sync):
    assert not controls["mirror"]
    k = sync[1]
    assert controls[f"spec{k}"] == run[f"plain{k}"]  # still exact: vLLM verifies every draft
    assert controls[f"spec{k}_counts"] != run[f"fresh{k}_counts"]
    assert not any(controls[f"drafter_matches_{sync}"].values())


def test_vllms_own_cpu_expand_kernel_samples_off_the_distribution(controls):
    """The control for the plugin's replacement of vllm-cpu's ``expand_kernel`` stand-in: with
    vLLM's own, speculative samples at temperature 1 are not the policy's."""
    assert controls["spec0"] == controls["plain0"]
    assert min(_pvalues(controls["spec0_samples"], controls["plain0_samples"])) < 1e-6
