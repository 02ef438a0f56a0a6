"""Every causal LM architecture the installed transformers ships, through the tree executor.

For each ``*ForCausalLM`` in transformers' causal-LM mapping: build it from its config class with
tiny sizes (hidden 32, 2 layers, 4 heads, 2 kv heads, vocab 61, whatever of these the config has;
default token ids past the tiny vocabulary are moved inside it; a layer pattern is cut to the tiny
depth keeping one layer of each kind; sub-configs (text, vision, audio) are shrunk the same way, and
a composite config whose causal LM is its text model builds that text config; multi-head latent
attention configs keep a key/value head per query head, see ``_mla_fields``), then the fields and
build steps of its entry in ``model_sweep_configs.py`` (the per-architecture table), and run keep,
replay (block 3) and packed mode on a GRPO-shaped forest against plain per-sequence autograd
(float64 where the model builds and runs in it, else float32): log-probs and every parameter
gradient. Each (architecture, mode) is one of

    exact       within the tolerance (float64 1e-10, float32 1e-4, relative to the largest norm)
    refused     UnsupportedModelError before any gradient changed (the message is recorded)
    mismatch    ran but disagrees                         -- a failure
    crash       any other exception, or state changed by a refusal -- a failure
    timeout     past --seconds per architecture           -- a failure

and an architecture is ``refused`` without running when the table's ``NEEDS`` says its forward
needs inputs a causal-LM run does not have, or when it needs a package not installed here (the
reason is recorded); ``unbuildable`` (its tiny config or model does not build) is a gap in the table.

``--precision bf16`` (bf16 autocast over float32 weights) and ``--precision bf16-weights`` (bf16
parameters) instead hold each mode to the criterion of tests/core/test_precision.py: on the batch
of those tests, per quantity (all log-probs; all parameter gradients), ``Bf16Rounding(tree, stock
bf16, stock float32).check_follows(near=1.5)``: the tree's distance from float32 stock is 0.5 to 1.5
times stock bf16's own, and within 1.5 of it from stock bf16. A mode is then ``pass`` or ``fail`` (or
refused or crash as above); ``stock fails`` marks an architecture whose own forward or backward
raises in that precision.

Prints a table and one line of JSON (docs/models.md is rendered from the float64 JSON by
scripts/models_page.py).

    .venv/bin/python scripts/model_sweep.py                      # every architecture, float64 (~2 min)
    .venv/bin/python scripts/model_sweep.py --precision bf16     # every architecture, bf16 autocast
    .venv/bin/python scripts/model_sweep.py --only llama,qwen3   # some (model_type names)
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
from model_sweep_configs import AFTER_BUILD, NEEDS, OVERRIDES  # noqa: E402

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
MAX_PARAMS = 20_000_000
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
MODES = (("keep", None), ("replay", 3), ("packed", None))


class Timeout(Exception):
    pass


def _tree_backward(model, forest, coefs, mode: str, block, ctx=None):
    """One mode's tree backward from zeroed gradients (inside ``ctx()``, if given): ``(result,
    None)``, or ``(None, row)`` for a refusal (a crash if it left any gradient behind) or a crash."""
    import contextlib

    from forkrl.core import TreeExecutor, UnsupportedModelError

    model.zero_grad(set_to_none=True)
    try:
        with (ctx or contextlib.nullcontext)():
            return TreeExecutor(model, mode=mode, block_size=block).backward(forest, coefs), None
    except UnsupportedModelError as err:
        clean = all(p.grad is None for p in model.parameters())
        return None, {"status": "refused" if clean else "crash", "why": str(err)[:300]}
    except Exception as err:  # noqa: BLE001 - a crash is a result here
        return None, {"status": "crash", "why": f"{type(err).__name__}: {str(err)[:300]}"}


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


_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id",
              "decoder_start_token_id", "start_token_id")  # fmt: skip


def _layer_types(probe, fields: dict, own: dict) -> None:
    """Cut a layer pattern to the tiny depth, keeping every kind of the full pattern (two layers of a
    3:1 linear/full pattern would hold no attention layer, which transformers' own cache cannot run)."""
    layers = fields.get("num_hidden_layers", 2)
    if "layer_types" in own or "hybrid_override_pattern" in fields:
        return
    full = getattr(probe, "layer_types", None)
    if not isinstance(full, (list, tuple)) or len(full) <= layers:
        return
    types = list(full)[:layers]
    missing = [k for k in dict.fromkeys(full) if k not in types]
    if missing and len(missing) < layers:
        types = types[: layers - len(missing)] + missing
    fields["layer_types"] = types


def _settable(probe, key: str) -> bool:
    """Whether the config has field ``key`` (also through its attribute map) and it is not a
    read-only property (Falcon's ``head_dim``, xLSTM's ``v_head_dim`` are derived from others)."""
    attr = getattr(type(probe), key, None)
    if isinstance(attr, property) and attr.fset is None:
        return False
    try:
        getattr(probe, key)
    except AttributeError:
        return False
    except Exception:  # noqa: BLE001 - a per-layer field (Gemma 4, dots3): present, set as a whole
        return True
    return True


def tiny_fields(probe, own: dict) -> dict:
    """The tiny fields of one config (``probe``: its defaults; ``own``: its entry in the table):
    the generic sizes it has, token ids kept inside the tiny vocabulary, a cut layer pattern, each
    sub-config shrunk the same way (as a dict over its defaults), then the table's fields."""
    from transformers import PreTrainedConfig

    own = dict(own)
    drop = set(own.pop("drop", ()))
    fields = {k: v for k, v in TINY.items() if k not in drop and _settable(probe, k)}
    if _settable(probe, "kv_lora_rank"):  # MLA (DeepSeek-V2/V3, Kimi K2, MiniCPM3, ...): its own head sizes
        fields.update(_mla_fields(probe))
    vocab = fields.get("vocab_size", TINY["vocab_size"])
    for key in _TOKEN_IDS:  # a default id past the tiny vocabulary fails an embedding's padding_idx check
        value = getattr(probe, key, None) if key in probe.to_dict() else None
        if isinstance(value, int) and value >= vocab:
            fields[key] = 0 if key == "pad_token_id" else vocab - 1
    for name in getattr(type(probe), "sub_configs", {}):
        sub = getattr(probe, name, None)
        if isinstance(sub, PreTrainedConfig):
            fields[name] = type(sub).from_dict({**sub.to_dict(), **tiny_fields(sub, own.pop(name, {}))})
    fields.update(own)
    _layer_types(probe, fields, own)
    return fields


def tiny_config(model_type: str, cls):
    """The tiny config of ``cls`` (a causal-LM class of ``model_type``), or raises (unbuildable)."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    own = OVERRIDES.get(model_type, {})
    subs = {c: name for name, c in getattr(config_cls, "sub_configs", {}).items()}
    if cls.config_class is not config_cls and cls.config_class in subs:
        # A composite config whose causal LM is its text model (Qwen3.5, Llama 4, Emu3): build that.
        own = own.get(subs[cls.config_class], {})
        config_cls = cls.config_class
    probe = config_cls(**own.get("probe", {}))
    fields = tiny_fields(probe, {k: v for k, v in own.items() if k != "probe"})
    try:
        config = config_cls(**fields)
    except (TypeError, ValueError, AttributeError):
        if "layer_types" not in fields or "layer_types" in own:
            raise
        fields.pop("layer_types")
        config = config_cls(**fields)
    try:
        config.use_cache = True
    except AttributeError:
        pass
    return config


def _all_configs(config) -> list:
    """The config and its sub-configs (attention and experts kernels are chosen per config)."""
    from transformers import PreTrainedConfig

    subs = [getattr(config, n, None) for n in getattr(type(config), "sub_configs", {})]
    return [config] + [c for c in subs if isinstance(c, PreTrainedConfig)]


def build(model_type: str, class_name: str, dtype):
    """The tiny model, or raises (unbuildable)."""
    import transformers

    from forkrl.core import compat

    cls = getattr(transformers, class_name)
    config = tiny_config(model_type, cls)
    for c in _all_configs(config):
        c._attn_implementation = "sdpa"
        if dtype == torch.float64:  # grouped_mm (the default experts kernel) has no float64 kernel
            compat.set_experts_implementation(c, "eager")
    with torch.device("meta"):  # size first: fields the tiny overrides miss can make it huge
        try:
            numel = sum(p.numel() for p in cls(config).parameters())
        except ValueError as err:  # no sdpa path (GPT-OSS's sinks, older models): their own eager attention
            if "scaled_dot_product_attention" not in str(err):
                raise
            for c in _all_configs(config):
                c._attn_implementation = "eager"
            numel = sum(p.numel() for p in cls(config).parameters())
    if numel > MAX_PARAMS:
        raise ValueError(
            f"{numel / 1e6:.0f}M parameters at the tiny sizes (a field the sweep does not shrink)"
        )
    torch.manual_seed(0)
    model = cls(config).to(dtype)
    model.eval()
    if model_type in AFTER_BUILD:
        method, args = AFTER_BUILD[model_type]
        getattr(model, method)(*args)
    return model


def check(model, dtype) -> dict[str, dict]:
    from forkrl.core import PrefixForest
    from forkrl.core.testing import Float64Mode
    from forkrl.core.testing.forests import grpo_group
    from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err

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
            res, failed = _tree_backward(model, forest, coefs, mode, block)
            if failed is not None:
                out[mode] = failed
                continue
            err_lp = max_rel_err(res.logprobs, [lp.detach() for lp in lps])
            err_g = max_rel_err(grads(model), want)
            ok = max(err_lp, err_g) < TOL[dtype]
            out[mode] = {"status": "exact" if ok else "mismatch", "logprob_err": err_lp, "grad_err": err_g}
    return out


def _flat(xs) -> torch.Tensor:
    return torch.cat([x.detach().double().flatten() for x in xs])


def _stock_bf16(model, seqs, sf, coefs) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain per-sequence autograd: all log-probs and all parameter gradients, flat."""
    from forkrl.core.testing.models import dense_logprobs, grads

    model.zero_grad(set_to_none=True)
    lps, _ = dense_logprobs(model, seqs, sf)
    sum((lp.float() * c).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
    return _flat(lps), _flat(grads(model))


def check_bf16(model, weights: bool) -> dict[str, dict]:
    """Each mode in bf16 against stock in bf16, both measured from stock in float32, with the
    criterion of tests/core/test_precision.py (``Bf16Rounding.check_follows(near=1.5)``, on the
    vector of all log-probs and the vector of all parameter gradients): under bf16 autocast over
    float32 weights (``weights=False``), or on bf16 weights (float32 stock then runs on the same
    bf16-rounded weights, so the gap is the computation's rounding alone)."""
    import contextlib

    from forkrl.core import PrefixForest
    from forkrl.core.testing import Bf16Rounding
    from forkrl.core.testing.forests import deep_tree, grpo_group
    from forkrl.core.testing.models import grads

    # The batch of tests/core/test_precision.py: a GRPO group and a deep multi-turn tree, so that the
    # bf16 gap is measured over enough tokens to be stable.
    (a, fa), (b, fb) = grpo_group(seed=3, group=6), deep_tree()
    seqs, sf = a + b, fa + fb
    g = torch.Generator().manual_seed(7)
    coefs = [torch.randn(len(s) - f, generator=g) for s, f in zip(seqs, sf, strict=True)]
    if weights:
        model = model.to(torch.bfloat16).float()
    exact = _stock_bf16(model, seqs, sf, coefs)
    if weights:
        model = model.to(torch.bfloat16)
    ctx = contextlib.nullcontext if weights else lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    with ctx():
        stock = _stock_bf16(model, seqs, sf, coefs)
    forest = PrefixForest.build(seqs, sf)
    out = {}
    for mode, block in MODES:
        res, failed = _tree_backward(model, forest, coefs, mode, block, ctx)
        if failed is not None:
            out[mode] = failed
            continue
        tree = (_flat(res.logprobs), _flat(grads(model)))
        row: dict = {"status": "pass"}
        for what, i in (("logprob", 0), ("grad", 1)):
            try:
                r = Bf16Rounding(what, tree[i], stock[i], exact[i])
                row[f"{what}_off"], row[f"{what}_near"] = r.off, r.near
                r.check_follows(near=1.5)
            except AssertionError as err:
                row["status"], row["why"] = "fail", str(err)[:300]
        out[mode] = row
    return out


def _run(row: dict, model_type: str, class_name: str, precision: str) -> None:
    """Fill ``row``: build (float64 where the model builds and runs in it, else float32; the bf16
    modes start from float32) and check, or record why not."""
    for dtype in (torch.float64, torch.float32) if precision == "float64" else (torch.float32,):
        try:
            model = build(model_type, class_name, dtype)
        except ImportError as err:  # an optional dependency (Gemma 3n's timm vision tower)
            row["why"] = "needs a package not installed here: " + " ".join(str(err).split())[:200]
            return
        except Exception as err:  # noqa: BLE001 - an architecture that does not build tiny
            row["build_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            continue
        try:
            if precision == "float64":
                row["modes"] = check(model, dtype)
            else:
                row["modes"] = check_bf16(model, weights=precision == "bf16-weights")
        except Exception as err:  # noqa: BLE001 - the dense reference itself failed
            if precision != "float64":  # stock itself does not run in bf16 (DBRX's, X-MOD's index ops)
                row["stock_error"] = f"{type(err).__name__}: {str(err)[:200]}"
                return
            row["build_error"] = f"reference: {type(err).__name__}: {str(err)[:200]}"
            continue
        row.pop("build_error", None)
        row["dtype"] = str(dtype).split(".")[1] if precision == "float64" else precision
        return


def sweep_one(model_type: str, class_name: str, seconds: float, precision: str = "float64") -> dict:
    """One architecture's row: its status, dtype, per-mode results (or why it did not run)."""
    row: dict = {"model_type": model_type, "class": class_name}
    start = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        if model_type in NEEDS:  # inputs a causal-LM run does not have: not run
            row["why"] = NEEDS[model_type]
        else:
            _run(row, model_type, class_name, precision)
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
        if "stock_error" in row:
            return "stock fails"
        return "refused" if row.get("why") else "unbuildable"
    states = {m["status"] for m in row["modes"].values()}
    for bad in ("crash", "mismatch", "fail"):
        if bad in states:
            return bad
    good = "pass" if "pass" in states else "exact"
    if states == {good}:
        return good
    return f"{good} (some modes refused)" if good in states else "refused"


def print_table(rows: list[dict], tf_version: str, precision: str = "float64") -> None:
    print(f"transformers {tf_version}: {len(rows)} causal-LM architectures ({precision})")
    print("| architecture | status | dtype | keep | replay | packed | note |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        modes = r.get("modes", {})
        cells = [modes.get(m, {}).get("status", "-") for m, _ in MODES]
        note = (
            r.get("build_error")
            or r.get("stock_error")
            or r.get("why")
            or next((v.get("why") for v in modes.values() if "why" in v), "")
            or ""
        )
        note = note[:120].replace("|", "/").replace("\n", " ")
        print(f"| {r['class']} | {r['status']} | {r.get('dtype', '-')} | {' | '.join(cells)} | {note} |")


def main() -> None:
    from transformers import __version__ as tf_version
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma list of model_type names")
    ap.add_argument("--seconds", type=float, default=120.0, help="per architecture")
    ap.add_argument(
        "--precision",
        choices=("float64", "bf16", "bf16-weights"),
        default="float64",
        help="float64: exact against plain autograd (float32 where a model does not run in float64); "
        "bf16: bf16 autocast over float32 weights, bf16-weights: bf16 parameters, each against stock's "
        "own bf16 error from float32 (pass/fail)",
    )
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
            rows.append(sweep_one(model_type, class_name, args.seconds, args.precision))
            r = rows[-1]
            print(f"{model_type:28s} {r['status']:28s} {r['seconds']:.1f}s", file=sys.stderr, flush=True)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print_table(rows, tf_version, args.precision)
    summary = {"sweep": "model_sweep", "transformers": tf_version, "precision": args.precision}
    print(json.dumps({**summary, "counts": counts, "rows": rows}))


if __name__ == "__main__":
    main()
