"""OpenRLHF end to end as users launch it, for tests and benchmarks: a whole GRPO run through
OpenRLHF's own ``train_ppo_ray`` (or forkrl's launcher) by forkrl's CPU run
(``python -m forkrl.plugins.openrlhf.cpu_run``) in a fresh process, on a tiny model with the
digit-fraction reward (:mod:`forkrl.core.testing.rewards`); what the run logged (TensorBoard) and
saved read back. ``--rollout hf`` records every sample to the rollout log its
:data:`~forkrl.plugins.openrlhf.cpu_rollout.ROLLOUT_LOG` names; :func:`launch` takes the shared
:data:`forkrl.core.testing.launcher.ROLLOUT_LOG` for it (and, like any variable, the workers' seed
:data:`~forkrl.plugins.openrlhf.cpu_patches.SEED`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from forkrl.core.testing import rewards
from forkrl.core.testing.launcher import ROLLOUT_LOG, run_launcher
from forkrl.core.testing.ranks import clean_env

from .cpu_rollout import ROLLOUT_LOG as CPU_ROLLOUT_LOG

__all__ = ["PROMPTS_PER_STEP", "flags", "launch", "saved_parameters", "scalars"]

PROMPTS_PER_STEP = 2


def flags(
    model: str,
    prompts: Path,
    out: Path,
    group: int = 4,
    per_step: int = PROMPTS_PER_STEP,
    max_new: int = 8,
    max_len: int = 32,
    lr: float = 1e-2,
    micro: int | None = None,
    attn: str = "sdpa",
) -> list[str]:
    """OpenRLHF's GRPO flags for the tiny run: by default 2 prompts x 4 samples of 8 tokens per step,
    one optimizer step per training step (train batch = rollout batch) of micro-batches of ``micro``
    rows (default half of it), KL loss against the reference, attention ``attn``."""
    rows = group * per_step
    return [
        "--actor.model_name_or_path", model, "--data.prompt_dataset", str(prompts),
        "--data.input_key", "input", "--reward.remote_url", str(rewards.PATH),
        "--vllm.num_engines", "1", "--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1",
        "--rollout.batch_size", str(per_step), "--rollout.n_samples_per_prompt", str(group),
        "--rollout.micro_batch_size", str(rows), "--rollout.max_new_tokens", str(max_new),
        "--data.max_len", str(max_len),
        "--train.micro_batch_size", str(micro or max(rows // 2, 1)), "--train.batch_size", str(rows), "--train.max_epochs", "1",
        "--algo.advantage.estimator", "group_norm",
        "--algo.kl.use_loss", "--algo.kl.init_coef", "1e-3", "--algo.kl.estimator", "k3",
        "--ds.zero_stage", "2", "--ds.attn_implementation", attn,
        # a large lr, no warmup: bf16 parameters move visibly in two steps
        "--actor.adam.lr", str(lr), "--actor.lr_warmup_ratio", "0",
        "--ckpt.output_dir", str(out / "final"), "--logger.tensorboard_dir", str(out / "tb"),
    ]  # fmt: skip


def launch(
    module: str,
    data: dict,
    out: Path,
    *extra: str,
    timeout: float = 480,
    extra_env: dict | None = None,
    rollout: str = "vllm",
    **run,
) -> dict:
    """Run ``module``'s launcher (forkrl's ``forkrl.plugins.openrlhf.train_ppo_ray`` or OpenRLHF's
    ``openrlhf.cli.train_ppo_ray``) through ``python -m forkrl.plugins.openrlhf.cpu_run --rollout
    ROLLOUT``; returns its log and wall time. ``run``: :func:`flags`' sizes; ``extra_env``: more
    environment variables (the e2e rollout log variable,
    :data:`forkrl.core.testing.launcher.ROLLOUT_LOG`, is the Hugging Face rollout's)."""
    stock = {"openrlhf.cli.train_ppo_ray": ["--stock"], "forkrl.plugins.openrlhf.train_ppo_ray": []}[module]
    cmd = [sys.executable, "-m", "forkrl.plugins.openrlhf.cpu_run", *stock, "--rollout", rollout]
    cmd += [*flags(data["model"], data["prompts"], out, **run), *extra]
    extra_env = dict(extra_env or {})
    if ROLLOUT_LOG in extra_env:
        extra_env[CPU_ROLLOUT_LOG] = extra_env.pop(ROLLOUT_LOG)
    env = clean_env(
        OMP_NUM_THREADS="1",
        # DeepSpeed's CPU ops, prebuilt in the environment by scripts/setup.sh (scripts/test.sh points here too)
        TORCH_EXTENSIONS_DIR=os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")
        ),
        HF_HOME=str(data["hf_home"]),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        RAY_DEDUP_LOGS="0",  # every line of the CPU rollout's, as printed (read by the resume test)
        **extra_env,
    )
    returncode, log, seconds = run_launcher(cmd, env=env, cwd=out, timeout=timeout)
    assert returncode == 0, log[-6000:]
    assert f"cpu_run: rollout {rollout}" in log
    print(f"{module}: {seconds:.1f} s")
    return {"log": log, "seconds": seconds, "out": out}


def scalars(tensorboard_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar OpenRLHF logged, by tag and step, read from its TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, float]] = {}
    runs = {path.parent for path in tensorboard_dir.rglob("events.out.tfevents.*")}
    assert runs, f"no TensorBoard log under {tensorboard_dir}"
    for run in runs:
        events = EventAccumulator(str(run), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            found.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    return found


def saved_parameters(path: str | Path) -> dict[str, torch.Tensor]:
    """The parameters of the model saved at ``path`` (``--ckpt.output_dir``, a Hugging Face model), in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {name: p.detach() for name, p in model.named_parameters()}
