"""Prefix Grouper (PyPI ``prefix-grouper``) beside forkrl tree training on GRPO-shaped batches.

For each model size, prompt length P and group size G (one prompt, G completions of R tokens, the
batch of benchmarks/tree_training.py), one optimizer-step's worth of forward and backward (the
gradient of sum(coef * logprob) over the completions) runs as:
    dense           padded per-sequence batches (``dense_step`` of tree_training.py), the plain path
    keep            forkrl ``TreeExecutor(model, mode="keep").backward(forest, coefs)``
    prefix_grouper  the prompt once and the G completions concatenated into one row; attention
                    split into prefix self-attention and suffix-over-(prefix + own suffix)
                    attention by ``prefix_grouper.PrefixGrouper`` (Liu et al., arXiv 2506.05433)
side by side in one process. Reports seconds, speedups over dense, autograd saved-tensor peaks,
and, on the first configuration, each method's largest per-parameter relative gradient difference
and largest log-prob difference against dense (float32). Prints a table, then one line of JSON.

    .venv/bin/pip install prefix-grouper     # 0.0.1.post1: pure Python, no dependencies
    .venv/bin/python -m benchmarks.prefix_grouper_compare --models micro --P 64 --G 2 --R 16   # smoke, seconds
    .venv/bin/python -m benchmarks.prefix_grouper_compare --models tiny --P 512 --G 4
    .venv/bin/python -m benchmarks.prefix_grouper_compare --models small --P 2048 --G 16      # the target row
    .venv/bin/python -m benchmarks.prefix_grouper_compare --models tiny,small --P 512,2048,8192 --G 4,8,16

``micro`` (hidden 64, 2 layers, GQA 4/2 heads, vocab 1024) is the forkrl.core.testing.models.SIZES
size for smoke tests only.

How Prefix Grouper is wired into transformers 5.x (all of it in this file, nothing patched globally):
  * ``prefix_grouper.utils.register_transformers.register_attention()`` registers its attention
    ("prefix_grouper_attention") in transformers' ``AttentionInterface``; the model forward gets
    ``prefix_grouper=`` and ``prefix_grouper_attn_func=`` as extra kwargs, which transformers
    passes through ``**kwargs`` to every attention call. For the duration of the Prefix Grouper
    forward only, ``config._attn_implementation`` is switched to "prefix_grouper_attention"
    (``_attention``); transformers then builds no 4D mask (the name is not in its mask interface).
  * The package's inner attention defaults to flash_attention_2 (not available on CPU) and hands
    the inner function a 2D padding mask over the keys, relying on flash-attn's varlen,
    bottom-right-aligned causal masking. transformers' sdpa/eager functions take a 4D mask
    instead (a 2D one is broadcast as [q, k]: the prefix call silently loses causality, the
    suffix call raises "The size of tensor a (R) must match the size of tensor b (G)"), and
    "eager" is not even a key of ALL_ATTENTION_FUNCTIONS. So this file registers
    "prefix_grouper_sdpa" / "prefix_grouper_eager": the 2D key mask becomes the bottom-right
    aligned causal 4D mask (queries are the last q_len key slots in both of the package's calls),
    or None (plain is_causal) when nothing is padded and q_len == k_len. "prefix_grouper_flash"
    (CUDA, for batches with nothing padded) calls torch's flash kernel through sdpa with
    ``causal_lower_right``: no mask is built or read (scripts/gpu_check.py uses it on the GPU).
  * Several groups per call (``PGBatch``): one row per group, padded on the right.
  * Position ids restart after the prompt for every completion: [0..P-1, P..P+R1-1, P..P+R2-1, ...].
  * The LM head runs only on the completion rows: ``split_output(hidden, include_prefix_last=1)``
    on the final hidden states, then ``lm_head`` (as dense's logits_to_keep does).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch

from benchmarks.common import machine, print_table, timed
from benchmarks.tree_training import dense_step, grpo_batch, ideal_flops
from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.testing import SavedBytes
from forkrl.core.testing.models import llama

PG_ATTN = "prefix_grouper_attention"


# ---------------------------------------------------------------- Prefix Grouper on transformers 5.x
def _key_mask_to_4d(key_mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """[b, k] key padding mask -> [b, 1, q, k] boolean causal mask, bottom-right aligned.

    Query i is the key slot k - q + i; it sees the valid keys whose rank (count of valid keys
    before them) is at most its own. Padded query rows see every key (their outputs are dropped),
    so no row is fully masked.
    """
    kv = key_mask.bool()
    rank = kv.long().cumsum(-1) - 1
    q_valid, q_rank = kv[:, -q_len:], rank[:, -q_len:]
    allowed = kv[:, None, :] & (rank[:, None, :] <= q_rank[:, :, None])
    return (allowed | ~q_valid[:, :, None])[:, None]


def _pg_sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("is_causal", None)
    if attention_mask is None or (attention_mask.shape[-1] == query.shape[2] and bool(attention_mask.all())):
        mask = None  # nothing padded, square: sdpa's own is_causal
    else:
        mask = _key_mask_to_4d(attention_mask, query.shape[2])
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def _pg_eager(module, query, key, value, attention_mask, **kwargs):
    eager = sys.modules[type(module).__module__].eager_attention_forward  # the model's own eager attention
    if attention_mask is None:
        attention_mask = torch.ones(query.shape[0], key.shape[2], dtype=torch.bool, device=query.device)
    allowed = _key_mask_to_4d(attention_mask, query.shape[2])
    additive = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
    additive.masked_fill_(~allowed, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, additive, **kwargs)


#: How ``_pg_flash`` serves GQA: None until its first call, then "native" (the flash kernel's own
#: grouped heads, through sdpa's ``enable_gqa``) or "repeated" (keys and values repeated per head).
FLASH_GQA: list[str | None] = [None]


def _lower_right(query, key, value, scale, gqa: bool):
    from torch.nn.attention.bias import causal_lower_right
    from transformers.integrations.sdpa_attention import repeat_kv

    bias = causal_lower_right(query.shape[2], key.shape[2])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if gqa:
        return sdpa(query, key, value, attn_mask=bias, scale=scale, enable_gqa=True)
    n_rep = query.shape[1] // key.shape[1]
    return sdpa(query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), attn_mask=bias, scale=scale)


def _probe_flash_gqa(query, key) -> str:
    """Returns "native" when this torch takes ``enable_gqa`` with a lower-right causal bias on this device
    and dtype, forward and backward, and agrees with repeated keys and values; else "repeated"."""
    g = torch.Generator(device="cpu").manual_seed(0)
    heads, kv, d = query.shape[1], key.shape[1], query.shape[-1]
    inputs = [
        torch.randn(s, generator=g).to(query) for s in ((1, heads, 16, d), (1, kv, 48, d), (1, kv, 48, d))
    ]
    try:
        results = []
        with torch.enable_grad():
            for gqa in (True, False):
                q, k, v = (t.clone().requires_grad_(True) for t in inputs)
                out = _lower_right(q, k, v, None, gqa)
                out.float().square().sum().backward()
                results.append([out.detach(), q.grad, k.grad, v.grad])
        agree = all(
            float((a.float() - b.float()).norm()) <= 2e-2 * float(b.float().norm())
            for a, b in zip(*results, strict=True)
        )
        return "native" if agree else "repeated"
    except (RuntimeError, TypeError):  # this torch's causal-bias dispatch takes no grouped heads
        return "repeated"


def _pg_flash(module, query, key, value, attention_mask, **kwargs):
    """Inner attention on torch's flash kernel (CUDA, bf16/fp16), for batches with nothing padded
    (``PGBatch.padded`` False; the mask is then all True and is not read, so no device value is
    read either): causal, bottom-right aligned through ``causal_lower_right`` (queries are the last
    ``q_len`` key slots in both of the package's calls). GQA natively where a first-use probe finds
    that torch's dispatch takes ``enable_gqa`` with a causal bias, else by repeating keys and
    values (:data:`FLASH_GQA`)."""
    scale = kwargs.get("scaling") or getattr(module, "scaling", None)
    gqa = query.shape[1] != key.shape[1]
    if gqa and FLASH_GQA[0] is None:
        FLASH_GQA[0] = _probe_flash_gqa(query, key)
    out = _lower_right(query, key, value, scale, gqa and FLASH_GQA[0] == "native")
    return out.transpose(1, 2).contiguous(), None


def register_prefix_grouper() -> None:
    """Register Prefix Grouper's attention and the inner attentions (sdpa, eager, flash) with transformers."""
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface

    register_attention()
    AttentionInterface.register("prefix_grouper_sdpa", _pg_sdpa)
    AttentionInterface.register("prefix_grouper_eager", _pg_eager)
    AttentionInterface.register("prefix_grouper_flash", _pg_flash)


@contextlib.contextmanager
def _attention(model, name: str):
    old = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = old


def _groups(seqs, score_from) -> list[tuple[int, list[int]]]:
    """Consecutive rows sharing a prompt (the tokens before their ``score_from``): (P, row indices)."""
    groups: list[tuple[int, list[int]]] = []
    for i, (s, sf) in enumerate(zip(seqs, score_from, strict=True)):
        if groups:
            P, rows = groups[-1]
            if sf == P and torch.equal(s[:P], seqs[rows[0]][:P]):
                rows.append(i)
                continue
        groups.append((sf, [i]))
    return groups


class PGBatch:
    """GRPO groups (each a shared prompt and completions of any lengths; a group's rows consecutive)
    laid out by Prefix Grouper: one row per group, [prompt | completion 1 | completion 2 | ...].

    Args:
        seqs: the rows' token tensors.
        score_from: where each row's completion starts (its prompt length).
        coefs: per row, ``[len - score_from]`` coefficients of its log-probs.
        device: where the layout and the grouper's indices live (the model's device).
    """

    def __init__(self, seqs, score_from, coefs, device=None):
        from prefix_grouper import PrefixGrouper

        device = torch.device(device if device is not None else "cpu")
        groups = _groups(seqs, score_from)
        comps = [s[sf:] for s, sf in zip(seqs, score_from, strict=True)]
        Pm, Rm = max(P for P, _ in groups), max(len(c) for c in comps)
        pids = torch.zeros(len(groups), Pm, dtype=torch.long)
        pmask = torch.zeros(len(groups), Pm, dtype=torch.bool)
        for g, (P, rows) in enumerate(groups):
            pids[g, :P], pmask[g, :P] = seqs[rows[0]][:P], True
        cids = torch.zeros(len(comps), Rm, dtype=torch.long)
        cmask = torch.zeros(len(comps), Rm, dtype=torch.bool)
        self.coef = torch.zeros(len(comps), Rm, dtype=coefs[0].dtype)
        for i, (c, k) in enumerate(zip(comps, coefs, strict=True)):
            cids[i, : len(c)], cmask[i, : len(c)], self.coef[i, : len(c)] = c, True, k
        self.padded = not (bool(pmask.all()) and bool(cmask.all()))
        pids, pmask, cids, cmask = (t.to(device) for t in (pids, pmask, cids, cmask))
        self.grouper = PrefixGrouper.from_ungrouped_masks(
            pmask, cmask, group_sizes=[len(rows) for _, rows in groups], device=device, padding_mode="right"
        )
        self.input_ids = self.grouper.concat_input(pids, pmask, cids, cmask)
        self.position_ids = torch.zeros_like(self.input_ids)
        for g, (P, rows) in enumerate(groups):
            pos = torch.cat([torch.arange(P)] + [torch.arange(P, P + len(comps[i])) for i in rows])
            self.position_ids[g, : len(pos)] = pos.to(self.position_ids.device)
        self.targets = self.grouper.convert_padding(cids, cmask, padding_mode="right")
        self.padding_mask = self.grouper.padding_mask.to(device)
        self.coef = self.coef.to(device)
        self.lengths = [len(c) for c in comps]


def pg_step(model, batch: PGBatch, inner: str = "prefix_grouper_sdpa", grad: bool = True):
    """Prefix Grouper forward (+ backward of sum(coef * logprob)); returns per-completion log-probs.
    ``inner="prefix_grouper_flash"`` only for batches with nothing padded (``batch.padded`` False)."""
    pg = batch.grouper
    if inner == "prefix_grouper_flash" and batch.padded:
        raise ValueError(
            "the flash inner attention takes batches with nothing padded: use prefix_grouper_sdpa"
        )
    with torch.set_grad_enabled(grad), _attention(model, PG_ATTN):
        hidden = model.model(
            input_ids=batch.input_ids,
            attention_mask=batch.padding_mask,
            position_ids=batch.position_ids,
            use_cache=False,
            prefix_grouper=pg,
            prefix_grouper_attn_func=inner,
        ).last_hidden_state
    with torch.set_grad_enabled(grad):
        # suffix rows: the prompt's last token, then every completion token; the last one predicts nothing
        _, _, suffix_h, suffix_mask = pg.split_output(hidden, include_prefix_last=1)
        logits = model.lm_head(suffix_h[:, :-1])
        lp = torch.log_softmax(logits.float(), -1).gather(-1, batch.targets[..., None])[..., 0]
        if grad:
            (lp * batch.coef.to(lp.dtype) * suffix_mask[:, 1:]).sum().backward()
    return [lp[i, :n].detach() for i, n in enumerate(batch.lengths)]


# ---------------------------------------------------------------- benchmark
def _grads(model) -> list[torch.Tensor]:
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]


def _max_rel(grads, ref) -> float:
    return max(
        ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
        for g, r in zip(grads, ref, strict=True)
        if r.norm() > 0
    )


def _flat_lp(method: str, out) -> torch.Tensor:
    if method == "dense":
        return torch.cat([x.reshape(-1) for x in out])
    if method == "keep":
        return torch.cat([x.reshape(-1) for x in out.logprobs])
    return torch.cat(out)


def _method_fn(method, model, seqs, sf, coefs, forest, pgb, args):
    """What one timed run of ``method`` calls (a keep executor is built here, outside the clock)."""
    if method == "dense":

        def fn():
            return dense_step(model, seqs, sf, coefs, args.dense_tokens, grad=True)
    elif method == "keep":
        ex = TreeExecutor(model, mode="keep")

        def fn(ex=ex):
            return ex.backward(forest, coefs)
    elif method == "prefix_grouper":

        def fn():
            return pg_step(model, pgb, inner=f"prefix_grouper_{args.pg_inner}")
    else:
        raise ValueError(f"unknown method {method!r}")
    return fn


def _check(row: dict, method: str, model, out, ref: dict) -> None:
    """Gradient and log-prob differences against dense's run (kept in ``ref``; methods before it
    are not compared)."""
    lp = _flat_lp(method, out)
    if method == "dense":
        ref["grads"], ref["lp"] = _grads(model), lp
    elif ref:
        row[f"{method}_grad_rel_diff"] = _max_rel(_grads(model), ref["grads"])
        row[f"{method}_logprob_max_abs_diff"] = (lp - ref["lp"]).abs().max().item()


def _ratios(row: dict, methods: list[str]) -> None:
    if "dense" in methods:
        for m in methods:
            if m != "dense":
                row[f"{m}_speedup"] = row["dense_s"] / row[f"{m}_s"]
    if "keep" in methods and "prefix_grouper" in methods:
        row["keep_over_prefix_grouper"] = row["prefix_grouper_s"] / row["keep_s"]


def run_config(model, name, P, G, R, methods, args, check: bool) -> dict:
    seqs, sf, coefs = grpo_batch(P, G, R, model.config.vocab_size)
    forest = PrefixForest.build(seqs, sf)
    d_fl, t_fl = ideal_flops(forest, name)
    row = {"model": name, "P": P, "G": G, "R": R, "ideal_flop_ratio": d_fl / t_fl}
    pgb = PGBatch(seqs, sf, coefs) if "prefix_grouper" in methods else None
    meter = SavedBytes()
    ref: dict = {}
    for method in methods:
        fn = _method_fn(method, model, seqs, sf, coefs, forest, pgb, args)
        best = float("inf")
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            with meter.measure():
                seconds, out = timed(fn)
            best = min(best, seconds)
        row[f"{method}_s"] = best
        row[f"{method}_saved_mb"] = meter.peak / 2**20
        print(f"  {name} P={P} G={G} {method}: {best:.2f}s", file=sys.stderr, flush=True)
        if check:
            _check(row, method, model, out, ref)
    model.zero_grad(set_to_none=True)
    _ratios(row, methods)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny", help="comma list of: micro, tiny, small")
    ap.add_argument("--P", default="512", help="comma list of prompt lengths")
    ap.add_argument("--G", default="4", help="comma list of group sizes")
    ap.add_argument("--R", type=int, default=256, help="completion length")
    ap.add_argument("--methods", default="dense,keep,prefix_grouper")
    ap.add_argument(
        "--pg-inner",
        default="sdpa",
        choices=("sdpa", "eager", "flash"),
        help="Prefix Grouper's inner attention (flash: CUDA)",
    )
    ap.add_argument("--dense-tokens", type=int, default=16384, help="tokens per dense micro-batch")
    ap.add_argument(
        "--repeats", type=int, default=1, help="time each method this many times, keep the fastest"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    if "prefix_grouper" in methods:
        try:
            register_prefix_grouper()
        except ImportError as e:
            raise SystemExit(f"{e}: pip install prefix-grouper, or pass --methods dense,keep") from e
    rows = []
    for name in args.models.split(","):
        model = llama(name)
        for P in (int(x) for x in args.P.split(",")):
            for G in (int(x) for x in args.G.split(",")):
                rows.append(run_config(model, name, P, G, args.R, methods, args, check=not rows))
    cols = [
        ("model", "{}"),
        ("P", "{}"),
        ("G", "{}"),
        ("R", "{}"),
        ("ideal_flop_ratio", "{:.2f}"),
        ("dense_s", "{:.2f}"),
        ("keep_s", "{:.2f}"),
        ("prefix_grouper_s", "{:.2f}"),
        ("keep_speedup", "{:.2f}"),
        ("prefix_grouper_speedup", "{:.2f}"),
        ("keep_over_prefix_grouper", "{:.2f}"),
        ("dense_saved_mb", "{:.0f}"),
        ("keep_saved_mb", "{:.0f}"),
        ("prefix_grouper_saved_mb", "{:.0f}"),
        ("keep_grad_rel_diff", "{:.1e}"),
        ("prefix_grouper_grad_rel_diff", "{:.1e}"),
        ("keep_logprob_max_abs_diff", "{:.1e}"),
        ("prefix_grouper_logprob_max_abs_diff", "{:.1e}"),
    ]
    print_table(rows, cols)
    try:
        from importlib.metadata import version

        pg_version = version("prefix-grouper")
    except Exception:  # pragma: no cover - not installed
        pg_version = None
    info = {**machine(), "prefix_grouper": pg_version}
    print(
        json.dumps({"benchmark": "prefix_grouper_compare", "machine": info, "args": vars(args), "rows": rows})
    )


if __name__ == "__main__":
    main()
