"""One GRPO run as a TRL user launches it: ``accelerate launch --multi_gpu --num_processes 2`` on a
CPU machine (accelerate's MULTI_CPU: 2 gloo processes), TRL's own generation, a checkpoint every 2
steps, SGD (so the comparison sees the update itself), optionally resumed from a checkpoint.

    accelerate launch --multi_gpu --num_processes 2 tests/trl/trl_e2e_train.py \\
        MODEL OUT tree|stock STEPS [CHECKPOINT]

Writes the final parameters to ``OUT/final.pt`` (rank 0); TRL writes its logs to
``OUT/checkpoint-*/trainer_state.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from forkrl.core.testing.ranks import finish  # noqa: E402
from tests.trl.trl_helpers import letter_reward, prompt_dataset  # noqa: E402


def main() -> None:
    model, out, mode, steps = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    resume = sys.argv[5] if len(sys.argv) > 5 else None
    if mode == "tree":
        from forkrl.plugins.trl import GRPOConfig, GRPOTrainer

        extra = {"tree_packing": True}
    else:
        from trl import GRPOConfig, GRPOTrainer

        extra = {}
    args = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        seed=7,
        max_steps=steps,
        save_steps=2,
        save_strategy="steps",
        logging_steps=1,
        report_to="none",
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        temperature=1.0,
        disable_tqdm=True,
        **extra,
    )
    trainer = GRPOTrainer(model, letter_reward, args=args, train_dataset=prompt_dataset(16, long=8))
    trainer.train(resume_from_checkpoint=resume)
    if trainer.accelerator.is_main_process:
        params = {
            n: p.detach().clone()
            for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
        }
        world = trainer.accelerator.num_processes, str(trainer.accelerator.distributed_type)
        torch.save({"params": params, "world": world}, out / "final.pt")
    # Neither TRL nor accelerate destroys the gloo group: left to interpreter exit it aborts the
    # process now and then (SIGABRT "terminate called without an active exception", stock TRL too:
    # 1 in 6 runs here), so the script ends it, as a careful user's does.
    finish()


if __name__ == "__main__":
    main()
