"""Attention of a tree node over its ancestors' cache without a materialised mask (CPU).

A node of ``q`` tokens attends to all ``c`` cached positions of its ancestors and causally to
itself. transformers expresses that with a ``[q, c + q]`` mask, which on the CPU is also kept for
backward and grows with the context (a 2048-token block over a 128k-token prompt holds a 1 GiB
float mask). Here the two parts run as two flash-attention calls, one unmasked over the cache and
one causal over the node, merged by their log-sum-exp:

    lse = log(exp(lse_past) + exp(lse_self))
    out = out_past * exp(lse_past - lse) + out_self * exp(lse_self - lse)

and backward runs the flash backward of each part with the merged ``out`` and ``lse``, which gives
each part's exact share of the gradient (the same identity ring attention uses).

The cache reaches the attention as the ancestors' own tensors, one piece per node or replay block
(:class:`PastPieces`, attached to the node's keys by the executor's cache), and each piece is one
more part of the merge. Concatenating them, as transformers' cache does, would copy the whole
context for every node: for long-context replay that copy is half again the memory of the cache
and its gradient together. Query heads that share a key/value head are folded into the query
length for the unmasked parts, so the pieces are not expanded to the query heads either.

Registered with transformers' ``AttentionInterface`` under :data:`NAME` at first use
(:func:`forkrl.core.attention.select`); the executor selects it for the duration of a tree pass
only, for models using sdpa whose layers all attend fully (no sliding window, no logit
softcapping). Anything else falls back to plain sdpa with an explicit mask.
"""

from __future__ import annotations

import logging

import torch
from torch.nn import functional as F

from .. import compat

__all__ = [
    "NAME",
    "PastPieces",
    "compute_dtype",
    "kernels_for",
    "masked_attention",
    "maskless_scale",
    "reference_attention",
    "split_attention",
]

logger = logging.getLogger(__name__)

NAME = "forkrl_tree_sdpa"

# Split only where the mask it avoids is large: below this many [query, past] elements one masked
# kernel call is faster than two calls and a merge (measured on the CPU: 10% slower at 256 x 2048,
# 1.5x faster and 3.5x less autograd memory at 2048-token blocks over a 16k prompt).
MIN_SPLIT_ELEMENTS = 1 << 22

# Cache pieces shorter than this are concatenated before attention (kernel calls per piece).
MIN_PIECE = 1024

# Per (device, dtype): the (forward, backward) flash kernels the split runs, or None (sdpa with a mask).
_KERNELS: dict[tuple[str, int | None, torch.dtype], tuple | None] = {}
# Largest head dimension the CUDA flash kernel takes.
CUDA_MAX_HEAD_DIM = 256


def kernels_for(device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> tuple | None:
    """The ``(forward, backward, gqa)`` flash kernels split attention runs for ``dtype`` tensors on
    ``device``, both in the CPU kernel's form (``(out, lse)``; ``(dq, dk, dv)``), and whether they
    take fewer key heads than query heads (GQA inside the kernel, nothing expanded); or None where
    there is none: then the model's attention runs with an explicit mask.

    CPU: torch's CPU flash kernels (every floating dtype). CUDA: the flash kernels for bf16/fp16,
    once checked on this device against a float64 reference on a small random input (split, GQA
    folded, a batch over shared pieces, forward and backward); a failure or a disagreement logs one
    line saying why and selects the fallback. float32 on CUDA: the fallback (the flash kernel takes
    half precision only), and head dimensions above :data:`CUDA_MAX_HEAD_DIM` (when given).
    """
    if device.type == "cuda" and head_dim is not None and head_dim > CUDA_MAX_HEAD_DIM:
        return None
    key = (device.type, device.index, dtype)
    if key not in _KERNELS:
        if device.type == "cpu":
            _KERNELS[key] = (compat.flash_cpu, compat.flash_cpu_backward, True)
        elif device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and compat.has_flash_cuda():
            # Fewer key heads than query heads inside the kernel first, else keys expanded to them.
            for gqa in (True, False):
                kernels = (compat.flash_cuda, compat.flash_cuda_backward, gqa)
                with torch.enable_grad(), torch.autocast(device.type, enabled=False):
                    why = _self_check(device, dtype, kernels)
                if why is None:
                    break
            if why is not None:
                logger.warning(
                    "forkrl split attention: CUDA flash kernels unusable (%s); using sdpa with a mask", why
                )
            _KERNELS[key] = kernels if why is None else None
        else:
            _KERNELS[key] = None
    return _KERNELS[key]


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype attention computes in for ``dtype`` inputs on ``device``: autocast's where it is
    enabled there and would cast them (float32 and half types; float64 is left alone), as it casts
    sdpa; else ``dtype``."""
    if dtype in (torch.float32, torch.float16, torch.bfloat16) and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


def reference_attention(q, k_self, v_self, keys, values, scale: float) -> torch.Tensor:
    """What split attention computes, the plain way, in float64: the pieces concatenated and expanded
    to every sequence and query head, one sdpa call with a bottom-right causal mask.

    Args:
        q: ``[b, h, q, d]``; k_self, v_self: ``[b, kv, q, d]``; keys, values: ``[1, kv, n_i, d]`` pieces.

    Returns:
        ``[b, h, q, d]`` float64 output, in the graph of the float64 copies' inputs.
    """
    b, h, q_len = q.shape[:3]
    n_rep = h // k_self.shape[1]
    past = sum(k.shape[-2] for k in keys)
    k_all = torch.cat([torch.cat(list(keys), -2).double().expand(b, -1, -1, -1), k_self.double()], -2)
    v_all = torch.cat([torch.cat(list(values), -2).double().expand(b, -1, -1, -1), v_self.double()], -2)
    rows = torch.arange(q_len, device=q.device)[:, None] + past
    mask = rows >= torch.arange(past + q_len, device=q.device)
    return F.scaled_dot_product_attention(
        q.double(), _expand(k_all, n_rep), _expand(v_all, n_rep), attn_mask=mask, scale=scale
    )


def _self_check(device: torch.device, dtype: torch.dtype, kernels: tuple) -> str | None:
    """None when the split over ``kernels`` matches float64 attention on a small input, else why not."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        b, h, kv, q_len, d, past = 2, 4, 2, 48, 64, (80, 40)
        rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
        q, k_self, v_self = rand(b, h, q_len, d), rand(b, kv, q_len, d), rand(b, kv, q_len, d)
        keys, values = [rand(1, kv, n, d) for n in past], [rand(1, kv, n, d) for n in past]
        leaves = [t.requires_grad_(True) for t in (q, k_self, v_self, *keys, *values)]
        out = _SplitAttention.apply(
            q, k_self, v_self, d**-0.5, h // kv, len(keys), kernels, dtype, False, *keys, *values
        )
        dout = rand(*out.shape)
        got = torch.autograd.grad(out, leaves, dout)
        ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
        ref = reference_attention(*ref_leaves[:3], ref_leaves[3:5], ref_leaves[5:], d**-0.5)
        want = torch.autograd.grad(ref, ref_leaves, dout.double())
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as err:
        return f"{type(err).__name__}: {err}"
    tol = 3e-2  # half precision, relative to the largest reference norm
    for name, a, w in [
        ("output", out, ref),
        *[(f"gradient {i}", x, y) for i, (x, y) in enumerate(zip(got, want, strict=True))],
    ]:
        a, w = a.detach(), w.detach()  # the outputs carry autograd: compare values only (float() warns)
        err = float((a.double() - w).norm() / max(float(w.norm()), 1e-12))
        if not err < tol:
            return f"{name} differs from the float64 reference by {err:.2e} (tolerance {tol})"
    return None


def _expand(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, kv, L, d]`` -> ``[B, kv * n_rep, L, d]`` (query heads of a group share a kv head)."""
    if n_rep == 1:
        return x
    b, kv, length, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, length, d).reshape(b, kv * n_rep, length, d)


def _reduce(g: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return g
    b, h, length, d = g.shape
    return g.view(b, h // n_rep, n_rep, length, d).sum(2)


def _fold(t: torch.Tensor, kv: int) -> torch.Tensor:
    """``[b, kv * r, q, ...]`` -> ``[1, kv, b * r * q, ...]``: every query of a kv-head group (all
    sequences of the batch, all query heads sharing that kv head) as one query run."""
    b = t.shape[0]
    t = t.reshape(b, kv, -1, *t.shape[3:]).transpose(0, 1)
    return t.reshape(1, kv, -1, *t.shape[3:])


def _unfold(t: torch.Tensor, b: int, h: int, q_len: int) -> torch.Tensor:
    """Inverse of :func:`_fold`: ``[1, kv, b * r * q, ...]`` -> ``[b, h, q, ...]``."""
    kv = t.shape[1]
    t = t.reshape(kv, b, -1, *t.shape[3:]).transpose(0, 1)
    return t.reshape(b, h, q_len, *t.shape[3:])


class _SplitAttention(torch.autograd.Function):
    """Attention over cache pieces (unmasked) and the node itself (causal), merged by log-sum-exp.

    The pieces are the ancestors' own key/value tensors (``[1, kv, n, d]``, shared by every sequence
    of the batch), saved by reference: nothing of the size of the context is copied. All queries of
    a kv-head group (query heads sharing the kv head, and every sequence of a batch of siblings) are
    folded into one query run for the unmasked parts, so the pieces are never expanded, and their
    gradient is one call's, summed over the batch by the kernel itself.

    ``latent=True`` (multi-head latent attention, :mod:`.latent`): the pieces are an MLA cache's
    latents ``[1, 1, n, rank]`` then its roped keys ``[1, 1, n, rope]``; each piece's key and value
    is their concatenation, formed per kernel call (one piece at a time, never saved), and its
    gradient is split back into the two.
    """

    @staticmethod
    def forward(  # noqa: D102
        ctx, q, k_self, v_self, scale: float, n_rep: int, n_pieces: int, kernels, dtype, latent: bool, *pieces
    ):
        b, h, q_len, d = q.shape
        kv = h // n_rep
        flash = kernels[0]
        # The kernels run in ``dtype`` (autocast's, as sdpa would be cast); the pieces are saved as
        # they are (by reference, no copy kept) and cast again per piece in backward.
        ctx.dtypes = (q.dtype, k_self.dtype, v_self.dtype)
        q, k_self, v_self = (t.to(dtype) for t in (q, k_self, v_self))
        q = q.contiguous()
        gqa = 1 if kernels[2] else n_rep  # kernels that take fewer key heads need no expansion
        out, lse = flash(q, _expand(k_self, gqa), _expand(v_self, gqa), 0.0, True, scale=scale)
        # Merged in the log-sum-exp's float32 where the kernel runs in half precision.
        out, lse = out.contiguous().to(torch.promote_types(q.dtype, lse.dtype)), lse.contiguous()
        q_fold = _fold(q, kv)
        for a, c in zip(pieces[:n_pieces], pieces[n_pieces:], strict=True):
            k, v = _piece_kv(a, c, latent, dtype)
            o_i, l_i = flash(q_fold, k, v, 0.0, False, scale=scale)
            o_i, l_i = _unfold(o_i, b, h, q_len), _unfold(l_i, b, h, q_len)
            out, lse = merge(out, lse, o_i, l_i)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_self, v_self, out, lse, *pieces)
        ctx.scale, ctx.n_rep, ctx.n_pieces, ctx.kernels, ctx.dtype = scale, n_rep, n_pieces, kernels, dtype
        ctx.latent = latent
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        q, k_self, v_self, out, lse, *pieces = ctx.saved_tensors
        n_rep, scale, n = ctx.n_rep, ctx.scale, ctx.n_pieces
        flash_bwd = ctx.kernels[1]
        b, h, q_len, d = q.shape
        dout = dout.contiguous()
        gqa = 1 if ctx.kernels[2] else n_rep
        k_e, v_e = _expand(k_self, gqa), _expand(v_self, gqa)
        dq, dk_self, dv_self = flash_bwd(dout, q, k_e, v_e, out, lse, 0.0, True, scale=scale)
        kv = h // n_rep
        dout_f, q_f, out_f, lse_f = (_fold(t, kv).contiguous() for t in (dout, q, out, lse))
        grads_a, grads_c = [], []
        dtype = ctx.dtype
        for a, c in zip(pieces[:n], pieces[n:], strict=True):
            k, v = _piece_kv(a, c, ctx.latent, dtype)
            dq_i, dk, dv = flash_bwd(dout_f, q_f, k, v, out_f, lse_f, 0.0, False, scale=scale)
            dq = dq + _unfold(dq_i, b, h, q_len)
            if ctx.latent:  # key and value were both [latent ; rope]
                dk = dk + dv
                dk, dv = dk[..., : a.shape[-1]], dk[..., a.shape[-1] :]
            grads_a.append(dk.to(a.dtype))
            grads_c.append(dv.to(c.dtype))
        q_dt, k_dt, v_dt = ctx.dtypes
        dk_self, dv_self = _reduce(dk_self, gqa).to(k_dt), _reduce(dv_self, gqa).to(v_dt)
        return (dq.to(q_dt), dk_self, dv_self, None, None, None, None, None, None, *grads_a, *grads_c)


def merge(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention results over disjoint keys merged by log-sum-exp, in four kernels.

    ``out = (out * e^lse + part * e^part_lse) / e^new`` with ``new = logaddexp(lse, part_lse)``,
    written as ``lerp(out, part, e^(part_lse - new))`` (the two weights sum to one).

    Args:
        out, part: ``[..., q, d]`` (``part`` cast to ``out``'s dtype); lse, part_lse: ``[..., q]``.
    """
    new = torch.logaddexp(lse, part_lse)
    weight = torch.exp(part_lse - new).unsqueeze(-1)
    return torch.lerp(out, part.to(out.dtype), weight.to(out.dtype)), new


def _piece_kv(a: torch.Tensor, c: torch.Tensor, latent: bool, dtype: torch.dtype):
    """One piece's ``(key, value)`` in ``dtype``: ``(a, c)``; latent: ``[a ; c]`` as both."""
    if not latent:
        return a.to(dtype), c.to(dtype)
    kv = torch.cat([a.to(dtype), c.to(dtype)], dim=-1)
    return kv, kv


def _coalesce(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """Concatenate runs of short pieces (one kernel call per piece costs more than a small copy)."""
    out: list[torch.Tensor] = []
    run: list[torch.Tensor] = []
    run_len = 0

    def flush() -> None:
        nonlocal run, run_len
        if run:
            out.append(torch.cat(run, dim=-2) if len(run) > 1 else run[0])
        run, run_len = [], 0

    for p in pieces:
        if p.shape[-2] >= MIN_PIECE:
            flush()
            out.append(p)
            continue
        run.append(p)
        run_len += p.shape[-2]
        if run_len >= MIN_PIECE:
            flush()
    flush()
    return out


class PastPieces:
    """The ancestors' keys/values of one layer, kept as separate pieces (attached to the node's keys).

    :class:`forkrl.core.models.ModelAdapter` hands them to :func:`split_attention` this way instead
    of concatenating them with the node's keys, which would copy the whole context for every node.
    ``used`` counts the attention calls that consumed them (the adapter checks it is one).

    Args:
        keys, values: one ``[1, kv, n_i, d]`` tensor per ancestor piece, in position order, shared
            by every sequence of the batch the node runs in (a batch of sibling leaves).
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = keys, values
        self.length = sum(k.shape[-2] for k in keys)
        self.used = 0

    def full(self, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, kv, c, d]`` keys and values (a copy; for the short contexts that take one kernel)."""
        cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs, dim=-2)  # noqa: E731
        keys, values = cat(self.keys), cat(self.values)
        return keys.expand(batch, *keys.shape[1:]), values.expand(batch, *values.shape[1:])


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past: int,
    dropout: float,
    scale: float,
) -> torch.Tensor:
    """Plain sdpa of ``q`` queries over ``past`` cached positions and causally over themselves,
    with an explicit bottom-right causal mask (dropout must use one kernel call).

    Args:
        query: ``[B, H, q, d]``; key: ``[B, kv, past + q, d]``; value: ``[B, kv, past + q, dv]``.

    Returns:
        ``[B, H, q, dv]``.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    n_rep = query.shape[1] // key.shape[1]
    mask = None
    if past > 0 and q_len > 1:
        rows = torch.arange(q_len, device=query.device)[:, None] + past
        mask = rows >= torch.arange(kv_len, device=query.device)[None, :]
    # Key heads shared inside the kernel where sdpa keeps a flash kernel for it (the CPU's, CUDA's
    # without a mask); elsewhere it would fall back to the math kernel, so they are expanded.
    gqa = n_rep > 1 and (query.device.type == "cpu" or mask is None)
    return F.scaled_dot_product_attention(
        query,
        key if gqa else _expand(key, n_rep),
        value if gqa else _expand(value, n_rep),
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=past == 0 and q_len > 1,
        scale=scale,
        enable_gqa=gqa,
    )


def maskless_scale(
    query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None, kwargs: dict
) -> float:
    """The softmax scale of a call that must need no mask (the split and latent paths), or raise."""
    if attention_mask is not None or kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise RuntimeError(f"{NAME} was selected for a layer that needs a mask; this is a forkrl bug")
    return scaling if scaling is not None else query.shape[-1] ** -0.5


def split_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: a node's queries over its ancestors' cache and itself.

    Args:
        query: ``[B, H, q, d]``.
        key, value: ``[B, kv, q, d]``, the node's own keys/values, carrying the ancestors' as a
            :class:`PastPieces` attribute (``key.forkrl_past``); or ``[B, kv, c + q, d]``, the
            ancestors' cache then the node's own, from a plain cache.
        attention_mask: must be None (this path is only selected where no mask is needed).

    Returns:
        ``[B, q, H, d]`` attention output, and None for the weights.
    """
    scale = maskless_scale(query, attention_mask, scaling, kwargs)
    pieces: PastPieces | None = getattr(key, "forkrl_past", None)
    q_len = query.shape[2]
    n_rep = query.shape[1] // key.shape[1]
    if pieces is not None:
        pieces.used += 1
        past = pieces.length
        k_self, v_self = key, value
    else:
        past = key.shape[2] - q_len
        k_self, v_self = key[:, :, past:], value[:, :, past:]
    # One masked call is faster for a small node, but for a batch of siblings it would copy the
    # context once per sequence: a batch always splits.
    small = q_len * past < MIN_SPLIT_ELEMENTS and query.shape[0] == 1
    # A plain cache's context may differ per sequence: the split folds only shared pieces.
    per_sequence = pieces is None and query.shape[0] > 1
    # Under autocast sdpa runs in autocast's dtype whatever its inputs' (RoPE leaves queries and keys
    # in float32 beside half-precision values): the split kernels are cast the same way.
    dtype = compute_dtype(query.device, query.dtype)
    kernels = kernels_for(query.device, dtype, query.shape[-1])
    if dropout > 0.0 or kernels is None or q_len == 1 or past == 0 or small or per_sequence:
        if pieces is not None and past > 0:
            k_past, v_past = pieces.full(query.shape[0])
            key, value = torch.cat([k_past, key], dim=-2), torch.cat([v_past, value], dim=-2)
        out = masked_attention(query, key, value, past, dropout, scale)
    else:
        if pieces is not None:
            keys, values = _coalesce(pieces.keys), _coalesce(pieces.values)
        else:
            keys, values = [key[:, :, :past]], [value[:, :, :past]]
        out = _SplitAttention.apply(
            query, k_self, v_self, scale, n_rep, len(keys), kernels, dtype, False, *keys, *values
        )
    return out.transpose(1, 2).contiguous(), None
