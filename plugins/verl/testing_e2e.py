"""veRL end to end as users launch it, for tests and benchmarks: ``python -m verl.trainer.main_ppo``
through forkrl's CPU smoke run (``python -m forkrl.plugins.verl.cpu_run``) in a fresh process, on a
tiny model and GSM8K-shaped data (:func:`build_inputs`), with the digit-fraction reward
(:mod:`forkrl.core.testing.rewards`); the run's metrics (veRL's file logger) and saved actor read back.

The Hugging Face rollout (``--rollout hf``) records every sample to the rollout log
(:data:`forkrl.core.testing.launcher.ROLLOUT_LOG`): :data:`HOST_MODULE`, which veRL loads in every
process after forkrl's own CPU module, re-registers the ``hf_cpu`` rollout with
:class:`RecordingReplica`. Sampling is the product's, unchanged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from forkrl.core.testing import rewards
from forkrl.core.testing.launcher import record_rollout, run_launcher
from forkrl.core.testing.models import byte_llama, byte_tokenizer, save_pretrained
from forkrl.core.testing.ranks import clean_env

from .cpu_rollout import HFReplica, HFServer

__all__ = [
    "GROUP", "HOST_MODULE", "PROMPTS_PER_STEP", "STEPS", "RecordingReplica", "build_inputs", "main_ppo",
    "metrics", "overrides", "saved_actor",
]  # fmt: skip

#: The module veRL loads in every process of these runs (``VERL_USE_EXTERNAL_MODULES``).
HOST_MODULE = "forkrl.plugins.verl.testing_host"
STEPS = 2
GROUP = 4
PROMPTS_PER_STEP = 2


class RecordingServer(HFServer):
    """:class:`~forkrl.plugins.verl.cpu_rollout.HFServer` that records each sample with the number
    of weight syncs it has had."""

    def sampled(self, prompt_ids: list[int], tokens: list[int]) -> None:
        record_rollout(self.weight_syncs, prompt_ids, tokens)


class RecordingReplica(HFReplica):
    server_class = RecordingServer


def build_inputs(
    root: Path, system: str = "", pairs: list[tuple[int, int]] | None = None, shape: dict | None = None
) -> dict:
    """A tiny Llama with a byte tokenizer (and a chat template, which veRL's dataset applies), and
    GSM8K-shaped parquet files as veRL's preprocessing scripts write them, under ``root``: one row
    per ``pairs`` entry, each prompt ``system`` (what the group's rows share beyond the question)
    then the question; ``shape``: the model's config fields (e.g. :data:`forkrl.plugins.verl.testing.VLLM_SHAPE`)."""
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


def overrides(
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
        f"reward.custom_reward_function.path={rewards.PATH}",
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
    ``run``: :func:`overrides`' sizes, ``extra_env``: more environment variables."""
    cmd = [sys.executable, "-m", "forkrl.plugins.verl.cpu_run", "--config-name", config or "ppo_trainer"]
    cmd += ["--rollout", rollout]
    cmd += [*overrides(inputs, out, **run), *extra]
    env = clean_env(
        OMP_NUM_THREADS="1",
        # after forkrl's CPU module (cpu_run puts it first): the rollout stand-in records its samples
        VERL_USE_EXTERNAL_MODULES=HOST_MODULE,
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
