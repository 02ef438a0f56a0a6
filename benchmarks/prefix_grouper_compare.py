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
    or None (plain is_causal) when nothing is padded and q_len == k_len.
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


def register_prefix_grouper() -> None:
    """Register Prefix Grouper's attention and the two CPU inner attentions with transformers."""
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface

    register_attention()
    AttentionInterface.register("prefix_grouper_sdpa", _pg_sdpa)
    AttentionInterface.register("prefix_grouper_eager", _pg_eager)


@contextlib.contextmanager
def _attention(model, name: str):
    old = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = old


class PGBatch:
    """One GRPO group (shared prompt, completions of any lengths) laid out by Prefix Grouper."""

    def __init__(self, seqs, score_from, coefs):
        from prefix_grouper import PrefixGrouper

        P = score_from[0]
        prompt = seqs[0][:P]
        if any(sf != P or not torch.equal(s[:P], prompt) for s, sf in zip(seqs, score_from, strict=True)):
            raise ValueError("prefix_grouper_compare expects one group: every sequence shares the prompt")
        comps = [s[P:] for s in seqs]
        G, Rm = len(comps), max(len(c) for c in comps)
        cids = torch.zeros(G, Rm, dtype=torch.long)
        cmask = torch.zeros(G, Rm, dtype=torch.bool)
        self.coef = torch.zeros(G, Rm, dtype=coefs[0].dtype)
        for i, (c, k) in enumerate(zip(comps, coefs, strict=True)):
            cids[i, : len(c)], cmask[i, : len(c)], self.coef[i, : len(c)] = c, True, k
        pmask = torch.ones(1, P, dtype=torch.bool)
        self.grouper = PrefixGrouper.from_ungrouped_masks(pmask, cmask, group_sizes=G, padding_mode="right")
        self.input_ids = self.grouper.concat_input(prompt[None], pmask, cids, cmask)
        self.position_ids = torch.cat([torch.arange(P)] + [torch.arange(P, P + len(c)) for c in comps])[None]
        self.targets = self.grouper.convert_padding(cids, cmask, padding_mode="right")
        self.lengths = [len(c) for c in comps]


def pg_step(model, batch: PGBatch, inner: str = "prefix_grouper_sdpa", grad: bool = True):
    """Prefix Grouper forward (+ backward of sum(coef * logprob)); returns per-completion log-probs."""
    pg = batch.grouper
    with torch.set_grad_enabled(grad), _attention(model, PG_ATTN):
        hidden = model.model(
            input_ids=batch.input_ids,
            attention_mask=pg.padding_mask,
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
        "--pg-inner", default="sdpa", choices=("sdpa", "eager"), help="Prefix Grouper's inner attention"
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
