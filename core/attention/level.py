"""Attention of a level of tree units over each unit's own ancestors, one kernel call per part.

A level pass (:mod:`forkrl.core.executor.levels`) runs the units at one depth of many trees as
one right-padded batch ``[N, W]``. Each unit attends causally to itself and, for every ancestor
depth ``j``, to its ancestor's keys in that depth's batch (``[N_j, kv, W_j, d]``, padded too). So
whatever the number of trees, a layer makes one causal call over the batch and one call per
ancestor depth:

- self: causal flash attention over ``[N, H, W, d]`` (query heads of a group share their key
  head inside the kernel: nothing is expanded);
- ancestors at depth ``j``: each unit's ancestor keys picked out of the depth's batch (one
  ``index_select``, ``[N, kv, W_j, d]``, formed again in backward rather than kept; a broadcast
  view where the depth holds one ancestor), the ancestors' padding masked by a ``[N, 1, 1, W_j]``
  additive mask (none where every ancestor fills its width);

merged by log-sum-exp (:func:`merge`). Backward runs each part's flash backward with the merged
output and log-sum-exp, which gives each part its exact share of the gradient (split attention's
identity, :mod:`.split`); the picked keys' gradient is summed back into the depth's batch with
one ``index_add_``.

Kernels (:func:`level_kernels_for`): on the CPU, torch's flash kernels (they take an additive
mask and fewer key heads). On CUDA, the flash kernels for the causal part and for unmasked
ancestors, and the memory-efficient kernel for masked ones (queries folded into their key head's
group, so keys are not expanded), once checked on the device against a float64 reference; where
the check fails the executor runs the depth-first pass instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .. import compat
from .latent import LatentKV, latent_attention
from .split import _expand, _reduce, compute_dtype, kernels_for, maskless_scale, merge, split_attention

__all__ = [
    "LevelKernels",
    "LevelMasks",
    "LevelPast",
    "level_attention",
    "level_kernels_for",
    "tree_attention",
]

logger = logging.getLogger(__name__)


class LevelKernels(NamedTuple):
    """The kernels of a level run, in the CPU flash kernel's form.

    Attributes:
        flash, flash_bwd: ``(q, k, v, dropout, causal, scale=)`` -> ``(out, lse)``; its backward
            ``(dout, q, k, v, out, lse, dropout, causal, scale=)`` -> ``(dq, dk, dv)``.
        gqa: whether ``flash`` takes fewer key heads than query heads (else keys are expanded).
        masked, masked_bwd: ``(q [N, H, W, d], k, v [N, kv, S, d], mask [N, 1, 1, S], scale)`` ->
            ``(out, lse)``; ``(dout, q, k, v, out, lse, mask, scale)`` -> ``(dq, dk, dv)``.
    """

    flash: Callable
    flash_bwd: Callable
    gqa: bool
    masked: Callable
    masked_bwd: Callable


def _cpu_masked(q, k, v, mask, scale):
    return compat.flash_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)


def _cpu_masked_bwd(dout, q, k, v, out, lse, mask, scale):
    return compat.flash_cpu_backward(dout, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)


def _fold(t: torch.Tensor, kv: int) -> torch.Tensor:
    """``[N, kv * r, W, ...]`` -> ``[N, kv, r * W, ...]``: a key head's queries as one run."""
    return t.reshape(t.shape[0], kv, -1, *t.shape[3:])


def _cuda_masked(q, k, v, mask, scale):
    n, h, w, d = q.shape
    kv = k.shape[1]
    qf = _fold(q, kv)
    out, lse = compat.efficient_cuda(qf, k, v, mask.expand(n, kv, qf.shape[2], -1), scale)
    return out.reshape(n, h, w, d), lse.reshape(n, h, w)


def _cuda_masked_bwd(dout, q, k, v, out, lse, mask, scale):
    n, h, w, d = q.shape
    kv = k.shape[1]
    folded = [_fold(t, kv) for t in (dout, q, out, lse)]
    bias = mask.expand(n, kv, folded[1].shape[2], -1)
    dq, dk, dv = compat.efficient_cuda_backward(*folded[:2], k, v, *folded[2:], bias, scale)
    return dq.reshape(n, h, w, d), dk, dv


_KERNELS: dict[tuple[str, int | None, torch.dtype], LevelKernels | None] = {}


def level_kernels_for(
    device: torch.device, dtype: torch.dtype, head_dim: int | None = None
) -> LevelKernels | None:
    """The kernels a level pass runs for ``dtype`` on ``device`` (:class:`LevelKernels`), or None
    where there are none: then the executor runs the depth-first pass. CUDA's are checked on the
    device at first use (:func:`self_check`); a failure logs one line saying why."""
    key = (device.type, device.index, dtype)
    if key in _KERNELS:
        return _KERNELS[key]
    kernels = None
    if device.type == "cpu" and dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        kernels = LevelKernels(
            compat.flash_cpu, compat.flash_cpu_backward, True, _cpu_masked, _cpu_masked_bwd
        )
    elif device.type == "cuda" and (split := kernels_for(device, dtype, head_dim)) is not None:
        kernels = LevelKernels(*split, _cuda_masked, _cuda_masked_bwd)
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            why = self_check(device, dtype, kernels)
        if why is not None:
            logger.warning("forkrl level pass: CUDA kernels unusable (%s); running depth first", why)
            kernels = None
    _KERNELS[key] = kernels
    return kernels


def reference(q, k_self, v_self, keys, values, index, lengths, scale: float) -> torch.Tensor:
    """What :func:`level_attention` computes, the plain way, in float64: per unit, its ancestors'
    keys cut to their lengths and its own, one sdpa call with a bottom-right causal mask.

    Args:
        q: ``[N, H, W, d]``; k_self, v_self: ``[N, kv, W, d]``; keys, values: per depth
            ``[N_j, kv, W_j, d]``; index: per depth ``[N]`` (or None: one ancestor); lengths: per depth ``[N]``.
    """
    n_rep = q.shape[1] // k_self.shape[1]
    outs = []
    for i in range(q.shape[0]):
        past_k, past_v = [], []
        for k_j, v_j, ix, n in zip(keys, values, index, lengths, strict=True):
            a, length = (0 if ix is None else int(ix[i])), int(n[i])
            past_k.append(k_j[a][:, :length])
            past_v.append(v_j[a][:, :length])
        k = torch.cat([*past_k, k_self[i]], 1).double()[None]
        v = torch.cat([*past_v, v_self[i]], 1).double()[None]
        w, past = q.shape[2], k.shape[2] - q.shape[2]
        mask = torch.arange(w, device=q.device)[:, None] + past >= torch.arange(k.shape[2], device=q.device)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[i : i + 1].double(), _expand(k, n_rep), _expand(v, n_rep), attn_mask=mask, scale=scale
            )
        )
    return torch.cat(outs)


def self_check(device: torch.device, dtype: torch.dtype, kernels: LevelKernels) -> str | None:
    """None when a level run over ``kernels`` matches float64 attention on a small input (a masked
    depth, a broadcast one, GQA; forward and backward), else why not."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
        n, h, kv, w, d = 3, 4, 2, 40, 64
        q, k_self, v_self = rand(n, h, w, d), rand(n, kv, w, d), rand(n, kv, w, d)
        keys, values = [rand(2, kv, 56, d), rand(1, kv, 24, d)], [rand(2, kv, 56, d), rand(1, kv, 24, d)]
        index = [torch.tensor([0, 1, 1], device=device), None]
        lengths = [torch.tensor([56, 33, 33], device=device), torch.tensor([24, 24, 24], device=device)]
        masks = LevelMasks(index, [lengths[0], None], [56, 24])
        leaves = [t.requires_grad_(True) for t in (q, k_self, v_self, *keys, *values)]
        out = _LevelAttention.apply(q, k_self, v_self, d**-0.5, kernels, dtype, masks, 2, *keys, *values)
        dout = rand(*out.shape)
        got = torch.autograd.grad(out, leaves, dout)
        ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
        ref = reference(*ref_leaves[:3], ref_leaves[3:5], ref_leaves[5:], index, lengths, d**-0.5)
        want = torch.autograd.grad(ref, ref_leaves, dout.double())
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as err:
        return f"{type(err).__name__}: {err}"
    tol = 1e-10 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 3e-2
    pairs = [
        ("output", out, ref),
        *[(f"gradient {i}", x, y) for i, (x, y) in enumerate(zip(got, want, strict=True))],
    ]
    for name, a, b in pairs:
        a, b = a.detach().double(), b.detach()
        err = float((a - b).norm() / max(float(b.norm()), 1e-12))
        if not err < tol:
            return f"{name} differs from the float64 reference by {err:.2e} (tolerance {tol})"
    return None


@dataclass(eq=False)
class LevelMasks:
    """The ancestors' key-padding masks of one level run, shared by its layers.

    Attributes:
        index: per ancestor depth, ``[N]`` device index of each unit's ancestor in that depth's
            batch, or None where that batch holds one unit (every unit's ancestor).
        lengths: per ancestor depth, ``[N]`` device length of each unit's ancestor, or None where
            every ancestor fills its batch's width (no mask).
        widths: per ancestor depth, the width ``W_j`` of its batch.
    """

    index: list[torch.Tensor | None]
    lengths: list[torch.Tensor | None]
    widths: list[int]
    _made: dict[torch.dtype, list[torch.Tensor | None]] = field(default_factory=dict)

    def masks(self, dtype: torch.dtype) -> list[torch.Tensor | None]:
        """Per ancestor depth, the ``[N, 1, 1, W_j]`` additive mask in ``dtype`` (0 or -inf), or None;
        made once per run and dtype."""
        if dtype not in self._made:
            made = []
            for n, width in zip(self.lengths, self.widths, strict=True):
                if n is None:
                    made.append(None)
                    continue
                # Rows a multiple of 16 apart, as CUDA's memory-efficient kernel wants its bias.
                pad = torch.arange(-(-width // 16) * 16, device=n.device) >= n[:, None]
                mask = torch.zeros(pad.shape, dtype=dtype, device=n.device).masked_fill_(pad, -torch.inf)
                made.append(mask[:, :width])
            self._made[dtype] = [m if m is None else m[:, None, None, :] for m in made]
        return self._made[dtype]


@dataclass(eq=False)
class LevelPast:
    """One layer's ancestors for a level run (attached to its keys by the level cache).

    Attributes:
        keys, values: per ancestor depth, that depth's ``[N_j, kv, W_j, d]`` keys and values.
        masks: the run's indices and masks (:class:`LevelMasks`).
        used: attention calls that consumed them (the cache checks it is one).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    masks: LevelMasks
    used: int = 0


def level_attention(
    query, key, value, past: LevelPast, scale: float, dtype: torch.dtype, kernels: LevelKernels
) -> torch.Tensor:
    """``[N, H, W, d]`` attention of a level's queries over themselves (causal) and their ancestors.

    Args:
        query: ``[N, H, W, d]``; key, value: ``[N, kv, W, d]``, the level's own.
        dtype: the kernels' dtype (autocast's, as sdpa would be cast).
    """
    past.used += 1
    n = len(past.keys)
    return _LevelAttention.apply(
        query, key, value, scale, kernels, dtype, past.masks, n, *past.keys, *past.values
    )


def tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The transformers attention function of tree passes: a level run's keys carry their units'
    ancestors (``key.forkrl_level``, :func:`level_attention`); an MLA layer's carry the latent
    cache (``key.forkrl_latent``, :func:`~forkrl.core.attention.latent.latent_attention`); any
    other call is a depth-first unit's (:func:`~forkrl.core.attention.split.split_attention`).

    Returns:
        ``[B, q, H, d]`` attention output, and None for the weights.
    """
    level: LevelPast | None = getattr(key, "forkrl_level", None)
    if level is None:
        latent: LatentKV | None = getattr(key, "forkrl_latent", None)
        if latent is not None:  # the latent cache, not per-head keys (see .latent)
            scale = maskless_scale(query, attention_mask, scaling, kwargs)
            return latent_attention(query, latent, dropout, scale).transpose(1, 2).contiguous(), None
        return split_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if attention_mask is not None or dropout > 0.0 or kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise RuntimeError("a level run reached a layer that needs a mask or dropout; this is a forkrl bug")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    dtype = compute_dtype(query.device, query.dtype)
    out = level_attention(
        query, key, value, level, scale, dtype, level_kernels_for(query.device, dtype, query.shape[-1])
    )
    return out.transpose(1, 2).contiguous(), None


def _pick(t: torch.Tensor, index: torch.Tensor | None, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Each unit's ancestor out of a depth's ``[N_j, ...]`` batch: ``[n, ...]`` in ``dtype`` (a
    broadcast view where the depth has one ancestor, else one ``index_select``)."""
    t = t.to(dtype)
    return t.expand(n, *t.shape[1:]) if index is None else t.index_select(0, index)


def _sum_back(t: torch.Tensor, index: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`_pick`: ``grad`` (``[n, ...]``) summed into ``t``'s rows, in float32
    for half-precision tensors (rounded once, as the plain computation's weight-gradient GEMM sums
    its sequences' parts) and laid out as ``t`` is (autograd then keeps it as the leaf's ``.grad``
    instead of copying it)."""
    acc = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype
    if acc == t.dtype:
        if index is None:
            return torch.sum(grad.to(acc), 0, keepdim=True, out=torch.empty_like(t))
        return torch.zeros_like(t).index_add_(0, index, grad.to(acc))
    if index is None:
        total = grad.sum(0, keepdim=True, dtype=acc)
    else:
        total = torch.zeros(t.shape, dtype=acc, device=t.device).index_add_(0, index, grad.to(acc))
    return torch.empty_like(t).copy_(total)


def _part(kernels: LevelKernels, q, k, v, mask, scale):
    """``(out, lse)`` of ``q`` over ``k``/``v`` (causal where ``mask`` is ``True``, else unmasked or masked)."""
    if mask is None or mask is True:
        gqa = 1 if kernels.gqa else q.shape[1] // k.shape[1]
        return kernels.flash(q, _expand(k, gqa), _expand(v, gqa), 0.0, mask is True, scale=scale)
    return kernels.masked(q, k, v, mask, scale)


def _part_bwd(kernels: LevelKernels, dout, q, k, v, out, lse, mask, scale):
    """``(dq, dk, dv)`` of :func:`_part` (``dk``/``dv`` with ``k``'s heads)."""
    if mask is None or mask is True:
        gqa = 1 if kernels.gqa else q.shape[1] // k.shape[1]
        dq, dk, dv = kernels.flash_bwd(
            dout, q, _expand(k, gqa), _expand(v, gqa), out, lse, 0.0, mask is True, scale=scale
        )
        return dq, _reduce(dk, gqa), _reduce(dv, gqa)
    return kernels.masked_bwd(dout, q, k, v, out, lse, mask, scale)


class _LevelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_self, v_self, scale, kernels, dtype, masks: LevelMasks, n: int, *kv):  # noqa: D102
        ctx.dtypes = (q.dtype, k_self.dtype, v_self.dtype)
        q, k_self, v_self = (t.to(dtype) for t in (q, k_self, v_self))
        out, lse = _part(kernels, q, k_self, v_self, True, scale)
        if lse.dtype != dtype:  # merged in the log-sum-exp's float32 where the kernel runs in half precision
            out = out.to(lse.dtype)
        for j, mask in enumerate(masks.masks(dtype)):
            index = masks.index[j]
            k, v = (_pick(t, index, q.shape[0], dtype) for t in (kv[j], kv[n + j]))
            out, lse = merge(out, lse, *_part(kernels, q, k, v, mask, scale))
        out = out.to(dtype)
        ctx.save_for_backward(q, k_self, v_self, out, lse, *kv)
        ctx.scale, ctx.kernels, ctx.dtype, ctx.masks, ctx.n = scale, kernels, dtype, masks, n
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        q, k_self, v_self, out, lse, *kv = ctx.saved_tensors
        kernels, scale, dtype, n = ctx.kernels, ctx.scale, ctx.dtype, ctx.n
        dout = dout.to(dtype)
        dq, dk_self, dv_self = _part_bwd(kernels, dout, q, k_self, v_self, out, lse, True, scale)
        grads = [None] * (2 * n)
        for j, mask in enumerate(ctx.masks.masks(dtype)):
            index = ctx.masks.index[j]
            k, v = (_pick(t, index, q.shape[0], dtype) for t in (kv[j], kv[n + j]))
            dq_j, dk, dv = _part_bwd(kernels, dout, q, k, v, out, lse, mask, scale)
            dq = dq + dq_j
            grads[j], grads[n + j] = _sum_back(kv[j], index, dk), _sum_back(kv[n + j], index, dv)
        q_dt, k_dt, v_dt = ctx.dtypes
        return (dq.to(q_dt), dk_self.to(k_dt), dv_self.to(v_dt), None, None, None, None, None, *grads)
