"""veRL end to end as users launch it: ``python -m verl.trainer.main_ppo`` with forkrl's YAML.

veRL's own entry point, TaskRunner, Ray workers, TransferQueue, agent loop, reward loop, weight sync
and checkpointing run a few GRPO steps on a tiny model, launched through forkrl's CPU smoke run
(``python -m forkrl.plugins.verl.cpu_run``: a CPU platform loaded by veRL's own
``VERL_USE_EXTERNAL_MODULES`` hook, and veRL's own vLLM rollout on vLLM's CPU build, or for the tree
run and its resume pair the Hugging Face rollout with a recorder, :mod:`tests.e2e.cpu_host.verl_host`).
Each run must exit 0, change the actor's parameters (its saved checkpoint against the initial
model) and, with forkrl, log ``tree/*`` in veRL's own metrics (its file logger); stock veRL runs
through the same harness and logs none. On vLLM, veRL's own comparison of the rollout's sampling
probabilities with the actor's shows that its weight sync reached the engine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from forkrl.core.testing.models import byte_llama, byte_tokenizer, save_pretrained
from forkrl.core.testing.ranks import clean_env
from tests.e2e.launch import run_launcher
from tests.verl import harness

pytestmark = pytest.mark.slow  # veRL's main_ppo end to end through Ray

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
GROUP = 4
PROMPTS_PER_STEP = 2


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    return build_inputs(tmp_path_factory.mktemp("verl-e2e"))


def build_inputs(
    root: Path, system: str = "", pairs: list[tuple[int, int]] | None = None, shape: dict | None = None
) -> dict:
    """A tiny Llama with a byte tokenizer (and a chat template, which veRL's dataset applies), and
    GSM8K-shaped parquet files as veRL's preprocessing scripts write them, under ``root``: one row
    per ``pairs`` entry, each prompt ``system`` (what the group's rows share beyond the question)
    then the question; ``shape``: the model's config fields (e.g. :data:`harness.VLLM_SHAPE`)."""
    import pandas as pd

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    model = save_pretrained(
        byte_llama(0, max_position_embeddings=1024, **(shape or {})), tokenizer, root / "model"
    )
    system = system or "You are a careful calculator. Answer with the digits of the result only. "
    pairs = pairs or [(12, 30), (7, 8), (21, 4), (5, 55), (9, 9), (40, 2)]
    rows = [
        {
            "data_source": "digits",
            "prompt": [{"role": "user", "content": f"{system}What is {a} + {b}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": i},
        }
        for i, (a, b) in enumerate(pairs)
    ]
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    pd.DataFrame(rows[:2]).to_parquet(root / "val.parquet")
    return {"root": root, "model": model}


def _overrides(
    inputs: dict,
    out: Path,
    steps: int = STEPS,
    group: int = GROUP,
    prompts: int = PROMPTS_PER_STEP,
    lr: float = 1e-3,
    max_prompt: int = 128,
    save_freq: int = 1,
    micro: int | None = None,
) -> list[str]:
    """veRL's overrides for a tiny GRPO run of ``steps`` steps of ``prompts`` prompts x ``group``
    (training micro-batches of ``micro`` rows, default ``group``), with the reference worker on;
    the CPU's own settings come from ``forkrl.plugins.verl.cpu_run``."""
    root = inputs["root"]
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={root / 'train.parquet'}",
        f"data.val_files={root / 'val.parquet'}",
        f"data.train_batch_size={prompts}",
        f"data.max_prompt_length={max_prompt}",
        "data.max_response_length=16",
        f"actor_rollout_ref.model.path={inputs['model']}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro or group}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        f"actor_rollout_ref.rollout.n={group}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={group}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={group}",
        f"reward.custom_reward_function.path={Path(__file__).with_name('e2e_reward.py')}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        f"trainer.save_freq={save_freq}",
        f"trainer.default_local_dir={out / 'ckpt'}",
        "trainer.resume_mode=disable",
        "trainer.logger=[console,file]",
        "trainer.project_name=forkrl-e2e",
        f"trainer.experiment_name={out.name}",
    ]


def main_ppo(
    inputs: dict,
    out: Path,
    config: str | None,
    *extra: str,
    rollout: str = "hf",
    timeout: float = 600,
    extra_env: dict | None = None,
    **run,
) -> str:
    """veRL's own entry point in a fresh process, launched as a user launches a CPU smoke run
    (``python -m forkrl.plugins.verl.cpu_run``): ``config`` names forkrl's YAML, None runs stock
    veRL; ``rollout``: ``vllm`` (veRL's vLLM server on vLLM's CPU build) or ``hf`` (the stand-in);
    ``run``: :func:`_overrides`' sizes, ``extra_env``: more environment variables."""
    cmd = [sys.executable, "-m", "forkrl.plugins.verl.cpu_run", "--config-name", config or "ppo_trainer"]
    cmd += ["--rollout", rollout]
    cmd += [*_overrides(inputs, out, **run), *extra]
    env = clean_env(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        # after forkrl's CPU module (cpu_run puts it first): the rollout stand-in records its samples
        VERL_USE_EXTERNAL_MODULES="tests.e2e.cpu_host.verl_host",
        VERL_FILE_LOGGER_PATH=str(out / "metrics.jsonl"),
        RAY_DEDUP_LOGS="0",
        **(extra_env or {}),
    )
    returncode, log, seconds = run_launcher(cmd, env=env, cwd=out, timeout=timeout)
    (out / "log.txt").write_text(log)
    assert returncode == 0, f"main_ppo failed (log: {out / 'log.txt'}):\n{log[-6000:]}"
    print(f"main_ppo {config or 'stock'}: {seconds:.1f} s")
    return log


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def saved_actor(out: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """The actor's parameters in veRL's step-``step`` checkpoint (its own FSDP format, one rank)."""
    saved = torch.load(
        out / "ckpt" / f"global_step_{step}" / "actor" / "model_world_size_1_rank_0.pt", weights_only=False
    )
    return {k: (v.to_local() if hasattr(v, "to_local") else v).float() for k, v in saved.items()}


def changed_parameters(inputs: dict, out: Path) -> float:
    """Largest change of any actor parameter: the step-``STEPS`` checkpoint against the initial model."""
    from transformers import AutoModelForCausalLM

    saved = saved_actor(out)
    initial = AutoModelForCausalLM.from_pretrained(inputs["model"]).state_dict()
    assert set(saved) == set(initial)
    return max((saved[k] - initial[k].float()).abs().max().item() for k in initial)


def check_run(inputs: dict, out: Path, log: str, tree: bool) -> list[dict]:
    """The run's own logs and checkpoint: every step logged, the actor trained, tree metrics iff ``tree``."""
    logged = metrics(out)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert changed_parameters(inputs, out) > 1e-4
    for m in logged:
        data = m["data"]
        assert data["critic/score/mean"] >= 0  # the reward ran
        tree_keys = [k for k in data if k.startswith("actor/tree/")]
        if tree:  # veRL prefixes the actor's metrics with actor/
            assert data["actor/tree/compression"] > 1.5, data["actor/tree/compression"]
            assert data["actor/tree/dense_tokens"] > data["actor/tree/unique_tokens"] > 0
        else:
            assert not tree_keys, tree_keys
    assert ("forkrl: veRL plugin active" in log) == tree
    return logged


@pytest.fixture(scope="module")
def tree_run(inputs, tmp_path_factory) -> tuple[Path, str]:
    """On the Hugging Face rollout (the stand-in), as its resume pair needs: see tests/e2e/cpu_host."""
    out = tmp_path_factory.mktemp("tree")
    return out, main_ppo(inputs, out, "forkrl_tree")


def test_the_tree_run_trains_and_logs_tree_metrics(inputs, tree_run):
    out, log = tree_run
    logged = check_run(inputs, out, log, tree=True)
    # veRL's gradient checkpointing is on in its default config: tree_mode auto replays
    assert all(m["data"]["actor/tree/mode"] == 1 for m in logged)


def test_resuming_from_a_checkpoint_equals_the_uninterrupted_run(inputs, tree_run, tmp_path):
    """veRL's own resume (``resume_mode=resume_path``) from the tree run's step-1 checkpoint reaches
    its step-2 parameters: veRL restores the optimizer, scheduler and data position, and forkrl
    keeps no state that changes the update (the rollout stand-in samples by prompt and position)."""
    out, _ = tree_run
    main_ppo(
        inputs,
        tmp_path,
        "forkrl_tree",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={out / 'ckpt' / 'global_step_1'}",
    )
    assert [m["step"] for m in metrics(tmp_path)] == [STEPS]  # only the step after the checkpoint ran
    resumed, uninterrupted, at_checkpoint = saved_actor(tmp_path), saved_actor(out), saved_actor(out, 1)
    assert (
        max((uninterrupted[k] - at_checkpoint[k]).abs().max().item() for k in resumed) > 1e-4
    )  # step 2 moved them
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)  # bitwise


@pytest.fixture(scope="module")
def vllm_inputs(tmp_path_factory) -> dict:
    """:func:`build_inputs` with a model vLLM's CPU build serves and forkrl's int4 drafter tiles."""
    pytest.importorskip("vllm")
    return build_inputs(tmp_path_factory.mktemp("verl-e2e-vllm"), shape=harness.VLLM_SHAPE)


def check_vllm_rollouts(logged: list[dict]) -> None:
    """veRL compares its rollout's sampling probabilities with the actor's: the engine starts from
    dummy weights (veRL's default load format), so they agree only if veRL's weight sync reached
    it (measured: about 5e-5; two different random models differ by about 4e-3)."""
    for m in logged:
        assert m["data"]["training/rollout_probs_diff_mean"] < 1e-3, m["data"][
            "training/rollout_probs_diff_mean"
        ]


def test_stock_verl_runs_through_the_same_harness_on_vllm(vllm_inputs, tmp_path):
    """Stock veRL with its own vLLM rollout (vLLMReplica, hybrid mode) on vLLM's CPU build."""
    log = main_ppo(vllm_inputs, tmp_path, None, rollout="vllm")
    check_vllm_rollouts(check_run(vllm_inputs, tmp_path, log, tree=False))


def test_the_long_context_run_trains_in_replay_on_vllm(vllm_inputs, tmp_path):
    log = main_ppo(vllm_inputs, tmp_path, "forkrl_long_context", rollout="vllm")
    logged = check_run(vllm_inputs, tmp_path, log, tree=True)
    assert all(m["data"]["actor/tree/mode"] == 1 for m in logged)
    check_vllm_rollouts(logged)


def test_the_tree_and_speculative_run_trains_on_vllm(vllm_inputs, tmp_path):
    """forkrl_tree_speculative: the tree in the actor, forkrl's int4 drafter in veRL's vLLM engine,
    re-synced by forkrl's vLLM plugin after every weight update veRL sends (its shared-memory
    bucketed transfer, ending in the engine's ``load_weights``)."""
    log = main_ppo(vllm_inputs, tmp_path, "forkrl_tree_speculative", rollout="vllm")
    check_vllm_rollouts(check_run(vllm_inputs, tmp_path, log, tree=True))
    assert "forkrl_int4_g128" in log  # vLLM's engine config, printed as it starts
