"""Shared measurement tools for the benchmarks: models from configs, memory meters, timing."""

from __future__ import annotations

import platform
import time

import torch

from forkrl.core.testing import SavedBytes  # noqa: F401  (re-exported for the benchmark scripts)

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is in the dev extra
    psutil = None

MODELS = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "tiny": (128, 4, 4, 4, 344, 32000),
    "small": (512, 8, 8, 8, 1376, 32000),
}


def make_llama(
    name: str, dtype: torch.dtype = torch.float32, attn: str = "sdpa", max_pos: int = 1 << 18, **overrides
):
    """A randomly initialised Llama of one of the sizes in :data:`MODELS` (seed 0).

    ``overrides`` are ``LlamaConfig`` fields that replace the size's own (e.g. ``num_hidden_layers=2``).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, inter, vocab = MODELS[name]
    fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_pos,
    )
    cfg = LlamaConfig(**{**fields, **overrides})
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype)


def flops_per_token(name: str) -> tuple[float, float, float]:
    """Forward FLOPs: (per token in linear layers, per token per context position in attention, LM head per row)."""
    hidden, layers, heads, kv, inter, vocab = MODELS[name]
    head_dim = hidden // heads
    linear = 2 * layers * (hidden * hidden * 2 + 2 * hidden * kv * head_dim + 3 * hidden * inter)
    attn = layers * 4 * heads * head_dim  # QK^T and AV, per query per key
    return float(linear), float(attn), float(2 * hidden * vocab)


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM). Unlike ``ru_maxrss``, which Linux carries over
    from the parent across fork and exec, it starts afresh in a new program."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def machine() -> dict:
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if psutil is not None:
        info["cores"] = psutil.cpu_count(logical=True)
        info["ram_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    return info


def print_table(rows: list[dict], cols: list[tuple[str, str]]) -> None:
    """Markdown table of the (key, format) columns that some row has; missing cells print '-'."""
    cols = [(c, f) for c, f in cols if any(c in r for r in rows)]
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f.format(r[c]) if c in r else "-" for c, f in cols) + " |")


def timed(fn):
    """(seconds, result) of ``fn()``; waits for queued GPU work on both sides of the clock."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out
