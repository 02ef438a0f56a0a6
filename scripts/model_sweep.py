"""Every causal LM architecture the installed transformers ships, through the tree executor.

For each ``*ForCausalLM`` in transformers' causal-LM mapping: build it from its config class with
tiny sizes (hidden 32, 2 layers, 4 heads, 2 kv heads, vocab 61, whatever of these the config has;
multi-head latent attention configs keep a key/value head per query head, see ``_mla_fields``),
then run keep, replay (block 3) and packed mode on a GRPO-shaped forest against plain
per-sequence autograd (float64 where the model builds in it, else float32): log-probs and every
parameter gradient. Each (architecture, mode) is one of

    exact       within the tolerance (float64 1e-10, float32 1e-4, relative to the largest norm)
    refused     UnsupportedModelError before any gradient changed (the message is recorded)
    mismatch    ran but disagrees                         -- a failure
    crash       any other exception, or state changed by a refusal -- a failure
    timeout     past --seconds per architecture           -- a failure
    unbuildable the config or model does not build at tiny sizes on this machine (not counted)

Prints a table and one line of JSON (docs/models.md is rendered from that JSON by scripts/models_page.py).

    .venv/bin/python scripts/model_sweep.py                     # every architecture
    .venv/bin/python scripts/model_sweep.py --only llama,qwen3  # some (model_type names)
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=61,
    max_position_embeddings=512,
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_positions=512,
    d_model=32,
    num_layers=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    kv_lora_rank=8,
    q_lora_rank=8,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=6,  # MLA: value heads narrower than query-key heads (nope + rope = 8), as in DeepSeek
)
# Hybrids whose layer pattern or mixer sizes the generic fields above do not reach (with two
# layers of the default pattern they would hold no attention layer, or fail a size check).
_MAMBA = dict(mamba_d_state=4, mamba_d_conv=3, mamba_expand=2)
OVERRIDES = {
    "bamba": dict(num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                  mamba_n_groups=2, mamba_chunk_size=4, **_MAMBA),
    "nemotron_h": dict(num_hidden_layers=3, hybrid_override_pattern="*MM", mamba_num_heads=4, mamba_head_dim=16,
                       n_groups=1, ssm_state_size=4, conv_kernel=3, expand=2, chunk_size=4),
    "granitemoehybrid": dict(num_hidden_layers=3, layer_types=["attention", "mamba", "mamba"], mamba_n_heads=4,
                             mamba_d_head=16, mamba_n_groups=1, mamba_chunk_size=4, **_MAMBA),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_dt_rank=4, use_mamba_kernels=False, **_MAMBA),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], mamba_headdim=16, n_mamba_heads=4, mamba_ngroups=1,
                   chunk_size=4, attention_head_dim=8, num_mem_blocks=1, **_MAMBA),
    "falcon_h1": dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_chunk_size=4, mamba_d_ssm=64,
                      **_MAMBA),
}  # fmt: skip
MAX_PARAMS = 20_000_000
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
MODES = (("keep", None), ("replay", 3), ("packed", None))


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


def _mla_fields(probe) -> dict:
    """An MLA config's tiny head sizes: every query head has its own key/value head (the latent is
    expanded per head: a smaller ``num_key_value_heads`` makes transformers repeat the expanded heads
    again under a mask), and the rotary embedding spans the rope part of the head (``head_dim``,
    which DeepSeek-V3-style configs set to ``qk_rope_head_dim``)."""
    fields = {"num_key_value_heads": TINY["num_attention_heads"]}
    if hasattr(probe, "head_dim"):
        fields["head_dim"] = TINY["qk_rope_head_dim"]
    if hasattr(probe, "n_group"):  # DeepSeek-V3 group-limited routing over the 4 tiny experts
        fields.update(n_group=2, topk_group=1)
    return fields


def build(model_type: str, class_name: str, dtype):
    """The tiny model, or raises (unbuildable)."""
    import transformers
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    probe = config_cls()
    fields = {k: v for k, v in TINY.items() if hasattr(probe, k)}
    if hasattr(probe, "kv_lora_rank"):  # MLA (DeepSeek-V2/V3, Kimi K2, MiniCPM3, ...): its own head sizes
        fields.update(_mla_fields(probe))
    fields.update(OVERRIDES.get(model_type, {}))
    layers = fields.get("num_hidden_layers", 2)
    pattern = "layer_types" in OVERRIDES.get(model_type, {}) or "hybrid_override_pattern" in fields
    if (
        not pattern
        and isinstance(getattr(probe, "layer_types", None), (list, tuple))
        and len(probe.layer_types) > layers
    ):
        types = list(probe.layer_types)[:layers]
        # Keep every kind of the full pattern (two layers of a 3:1 linear/full pattern would hold no
        # attention layer, which transformers' own cache cannot run).
        missing = [k for k in dict.fromkeys(probe.layer_types) if k not in types]
        if missing and len(missing) < layers:
            types = types[: layers - len(missing)] + missing
        fields["layer_types"] = types
    try:
        config = config_cls(**fields)
    except (TypeError, ValueError, AttributeError):
        fields.pop("layer_types", None)
        config = config_cls(**fields)
    config._attn_implementation = "sdpa"
    if dtype == torch.float64:  # grouped_mm (the default experts kernel) has no float64 kernel
        from forkrl.core import compat

        compat.set_experts_implementation(config, "eager")
    try:
        config.use_cache = True
    except AttributeError:
        pass
    cls = getattr(transformers, class_name)
    with torch.device("meta"):  # size first: fields the tiny overrides miss can make it huge
        try:
            numel = sum(p.numel() for p in cls(config).parameters())
        except ValueError as err:  # no sdpa path (GPT-OSS's sinks, older models): their own eager attention
            if "scaled_dot_product_attention" not in str(err):
                raise
            config._attn_implementation = "eager"
            numel = sum(p.numel() for p in cls(config).parameters())
    if numel > MAX_PARAMS:
        raise ValueError(
            f"{numel / 1e6:.0f}M parameters at the tiny sizes (a field the sweep does not shrink)"
        )
    torch.manual_seed(0)
    model = cls(config).to(dtype)
    model.eval()
    return model


def check(model, dtype) -> dict[str, dict]:
    from forkrl.core import PrefixForest, TreeExecutor, UnsupportedModelError
    from forkrl.core.testing import Float64Mode
    from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err
    from tests.core.forests import grpo_group

    seqs, sf = grpo_group(vocab=61)
    g = torch.Generator().manual_seed(3)
    coefs = [torch.randn(len(s) - f, generator=g, dtype=dtype) for s, f in zip(seqs, sf, strict=True)]
    ctx = Float64Mode() if dtype == torch.float64 else torch.enable_grad()
    out = {}
    with ctx:
        model.zero_grad(set_to_none=True)
        lps, _ = dense_logprobs(model, seqs, sf)
        sum((lp * c).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
        want = grads(model)
        forest = PrefixForest.build(seqs, sf)
        for mode, block in MODES:
            model.zero_grad(set_to_none=True)
            try:
                res = TreeExecutor(model, mode=mode, block_size=block).backward(forest, coefs)
            except UnsupportedModelError as err:
                clean = all(p.grad is None for p in model.parameters())
                out[mode] = {"status": "refused" if clean else "crash", "why": str(err)[:300]}
                continue
            except Exception as err:  # noqa: BLE001 - a crash is a result here
                out[mode] = {"status": "crash", "why": f"{type(err).__name__}: {str(err)[:300]}"}
                continue
            err_lp = max_rel_err(res.logprobs, [lp.detach() for lp in lps])
            err_g = max_rel_err(grads(model), want)
            ok = max(err_lp, err_g) < TOL[dtype]
            out[mode] = {"status": "exact" if ok else "mismatch", "logprob_err": err_lp, "grad_err": err_g}
    return out


def sweep_one(model_type: str, class_name: str, seconds: float) -> dict:
    """One architecture's row: its status, dtype, per-mode results (or why it did not build)."""
    row: dict = {"model_type": model_type, "class": class_name}
    start = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        model = dtype = None
        for dtype in (torch.float64, torch.float32):
            try:
                model = build(model_type, class_name, dtype)
                break
            except Exception as err:  # noqa: BLE001 - an architecture that does not build tiny
                row["build_error"] = f"{type(err).__name__}: {str(err)[:200]}"
        if model is not None:
            row.pop("build_error", None)
            row["dtype"] = str(dtype).split(".")[1]
            try:
                row["modes"] = check(model, dtype)
            except Exception as err:  # noqa: BLE001 - the dense reference itself failed
                row["build_error"] = f"reference: {type(err).__name__}: {str(err)[:200]}"
        row["status"] = _status(row)
    except Timeout:
        row["status"] = "timeout"
    except Exception:  # noqa: BLE001 - outside the executor: the sweep's own failure
        row["status"] = "crash"
        row["why"] = traceback.format_exc()[-300:]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    row["seconds"] = time.perf_counter() - start
    return row


def _status(row: dict) -> str:
    if "modes" not in row:
        return "unbuildable"
    states = {m["status"] for m in row["modes"].values()}
    for bad in ("crash", "mismatch"):
        if bad in states:
            return bad
    if states == {"exact"}:
        return "exact"
    return "exact (some modes refused)" if "exact" in states else "refused"


def print_table(rows: list[dict], tf_version: str) -> None:
    print(f"transformers {tf_version}: {len(rows)} causal-LM architectures")
    print("| architecture | status | dtype | keep | replay | packed | note |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        modes = r.get("modes", {})
        cells = [modes.get(m, {}).get("status", "-") for m, _ in MODES]
        note = r.get("build_error") or next((v.get("why") for v in modes.values() if "why" in v), "") or ""
        note = note[:120].replace("|", "/").replace("\n", " ")
        print(f"| {r['class']} | {r['status']} | {r.get('dtype', '-')} | {' | '.join(cells)} | {note} |")


def main() -> None:
    from transformers import __version__ as tf_version
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma list of model_type names")
    ap.add_argument("--seconds", type=float, default=120.0, help="per architecture")
    ap.add_argument("--memory-gib", type=float, default=8.0, help="address-space limit of the sweep")
    args = ap.parse_args()
    only = {s for s in args.only.split(",") if s}
    # A config whose tiny overrides miss its big fields (a 256k vocabulary, say) must fail to build,
    # not take the machine's memory: allocations past this limit raise MemoryError.
    resource.setrlimit(resource.RLIMIT_AS, (int(args.memory_gib * 2**30), resource.RLIM_INFINITY))
    signal.signal(signal.SIGALRM, _alarm)
    rows = []
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if not only or model_type in only:
            rows.append(sweep_one(model_type, class_name, args.seconds))
            r = rows[-1]
            print(f"{model_type:28s} {r['status']:28s} {r['seconds']:.1f}s", file=sys.stderr, flush=True)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print_table(rows, tf_version)
    print(json.dumps({"sweep": "model_sweep", "transformers": tf_version, "counts": counts, "rows": rows}))


if __name__ == "__main__":
    main()
