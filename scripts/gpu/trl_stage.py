"""The trl stage: stock ``trl.GRPOTrainer`` against forkrl's ``tree_packing=True`` on the device,
as benchmarks/trl_step.py runs them (fixed rollouts from a ``rollout_func``, one optimizer step's
``training_step`` calls, the two trainers alternating step by step, the same prompts), at the
0.5B widths: P=2048, G=8, R=512, one group per optimizer step, 4 rows per micro-batch (2
micro-batches), TRL's default ``bf16=True`` over a bf16 checkpoint (TRL loads it in its own
dtype), gradient checkpointing off in both (TRL's default is on; forkrl then picks replay mode).
Each optimizer step is timed between CUDA events (synchronized outside them); the figure is the
median over the measured steps after one warm-up step each. The gradients of the last step are
compared: max |tree - stock| / max |stock|.

Skipped, with the reason, when ``import trl`` fails (on the GPU machine TRL comes from the wheels
of scripts/gpu_wheels.sh).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from .measure import timed_call
from .shapes import QWEN_05B, TINY, build_model

FULL = {"widths": QWEN_05B, "P": 2048, "G": 8, "R": 512, "micro_batch": 4, "steps": 3}
SMALL = {"widths": TINY, "P": 32, "G": 4, "R": 8, "micro_batch": 2, "steps": 2}


def _import_trl() -> str | None:
    """None when TRL, datasets and forkrl's TRL plugin import; else why not."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401

        from forkrl.plugins import trl as _  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure is the reason to skip
        import transformers

        return (
            f"import trl failed with transformers {transformers.__version__}: {type(err).__name__}: "
            f"{str(err)[:400]}"
        )
    return None


def _trainer(method: str, spec: dict, path: str, tok, out: Path, cpu: bool):
    import trl
    from datasets import Dataset

    from benchmarks.trl_step import reward, rollouts
    from forkrl.plugins import trl as ftrl

    vocab = spec["widths"].vocab
    common = dict(
        output_dir=str(out / method),
        use_cpu=cpu,
        bf16=not cpu,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=spec["micro_batch"],
        num_generations=spec["G"],
        gradient_accumulation_steps=spec["G"] // spec["micro_batch"],
        max_completion_length=spec["R"],
        seed=0,
        gradient_checkpointing=False,
        disable_dropout=True,
    )
    if method == "stock":
        config, cls = trl.GRPOConfig(**common), trl.GRPOTrainer
    else:
        config, cls = ftrl.GRPOConfig(**common, tree_packing=True), ftrl.GRPOTrainer
    return cls(
        model=path,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["t0"]}),
        processing_class=tok,
        rollout_func=rollouts(spec["P"], spec["R"], vocab, vocab - 1),
    )


def _step(trainer, batch) -> None:
    """One optimizer step's worth of ``training_step`` calls, as the Trainer's inner loop runs them
    (benchmarks/trl_step.py's ``optimizer_step_work`` without its host clock)."""
    model = trainer.model_wrapped
    gas = trainer.args.gradient_accumulation_steps
    trainer.current_gradient_accumulation_steps = gas
    state = trainer.accelerator.gradient_state
    for i in range(gas):
        state._set_sync_gradients(i == gas - 1)
        trainer.training_step(model, batch, None)


def stage_trl(ctx) -> dict:
    import torch

    from forkrl.core.testing.models import word_tokenizer

    why = _import_trl()
    if why is not None:
        return {"status": "skipped", "why": why}
    import trl

    dev, spec = ctx.device, (SMALL if ctx.tiny else FULL)
    cpu = dev.type != "cuda"
    w = spec["widths"]
    out: dict = {
        "trl": trl.__version__,
        "model": w.name,
        **{k: spec[k] for k in ("P", "G", "R", "micro_batch")},
        "bf16": not cpu,
        "gradient_checkpointing": False,
    }
    times: dict[str, list[float]] = {"stock": [], "tree": []}
    grads: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        tok = word_tokenizer(w.vocab)
        model = build_model(w, w.layers, dev, torch.float32 if cpu else torch.bfloat16, spec["P"] + spec["R"])
        for cfg in (model.config, model.generation_config):
            cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
        model.to("cpu").save_pretrained(Path(tmp) / "model")  # bf16 on the device: TRL loads it as such
        tok.save_pretrained(Path(tmp) / "model")
        del model
        trainers = {m: _trainer(m, spec, str(Path(tmp) / "model"), tok, Path(tmp), cpu) for m in times}
        batch = next(iter(trainers["stock"].get_train_dataloader()))
        out["setup_s"] = time.monotonic() - t0
        ctx.partial(out)
        for rep in range(spec["steps"] + 1):  # the methods alternate step by step; step 0 warms up
            for m, trainer in trainers.items():
                trainer.model_wrapped.zero_grad(set_to_none=True)
                ms, _ = timed_call(lambda trainer=trainer: _step(trainer, batch), dev)
                if rep:
                    times[m].append(ms)
            out["ms"] = times
            ctx.partial(out)
        for m, trainer in trainers.items():
            grads[m] = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
        metrics = trainers["tree"]._metrics["train"]
        out["tree_metrics"] = {k: v[-1] for k, v in metrics.items() if k.startswith("tree/") and v}
    out["stock_ms"] = statistics.median(times["stock"])
    out["tree_ms"] = statistics.median(times["tree"])
    out["speedup"] = out["stock_ms"] / out["tree_ms"]
    norm = max(float(g.abs().max()) for g in grads["stock"].values())
    out["grad_error"] = (
        max(float((grads["stock"][n].float() - grads["tree"][n].float()).abs().max()) for n in grads["stock"])
        / norm
    )
    return out


def print_trl(result: dict) -> None:
    if "speedup" not in result:
        return
    print(
        f"\ntrl: stock GRPOTrainer {result['stock_ms']:.0f} ms vs tree_packing {result['tree_ms']:.0f} ms per "
        f"optimizer step ({result['speedup']:.2f}x; {result['model']}, P={result['P']} G={result['G']} "
        f"R={result['R']}, bf16={result['bf16']}); gradient error {result['grad_error']:.1e}"
    )
