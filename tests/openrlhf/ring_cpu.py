"""Test-only: OpenRLHF's ring attention (``--ds.ring_attn_size``) on the CPU, the reference forkrl's
trainer is compared with.

OpenRLHF splits each packed micro-batch over the ring group (``unpad_and_slice_tensor``), runs the
model with ``ring_flash_attn``'s llama3 varlen attention (an all-gather of the keys and values per
layer, a reduce-scatter of their gradient) and all-gathers the log-probs back. All of that is the
real code, on gloo; only flash-attention's two CUDA kernels that ``ring_flash_attn`` calls are
replaced (:func:`varlen_forward`, :func:`varlen_backward`: the same softmax attention per packed
sequence, causal aligned to the end of the keys as flash-attention aligns it, computed in float32,
the backward by recomputation), and the actor is switched to flash-attention and the packed layout
after it is built (transformers refuses to load ``flash_attention_2`` without CUDA kernels).
"""

from __future__ import annotations

import torch


def _attend(q, k, v, cu_q, cu_k, scale: float, causal: bool):
    """Per packed sequence: ``q`` ``[Tq, H, d]`` over ``k``/``v`` ``[Tk, H_k, d]``; (out, lse ``[H, Tq]``)."""
    rep = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for qa, qb, ka, kb in zip(
        cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist(), strict=True
    ):
        qs = q[qa:qb].transpose(0, 1).float()
        ks = k[ka:kb].transpose(0, 1).float().repeat_interleave(rep, dim=0)
        vs = v[ka:kb].transpose(0, 1).float().repeat_interleave(rep, dim=0)
        scores = qs @ ks.transpose(1, 2) * scale  # [H, nq, nk]
        if causal:  # query i sees key j <= i + (nk - nq): the queries are the keys' last nq
            nq, nk = qb - qa, kb - ka
            allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
            scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        outs.append((torch.exp(scores - lse[..., None]) @ vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)


def varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
    window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
    block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False,
):  # fmt: skip
    """``flash_attn_interface._flash_attn_varlen_forward``: ``(out, softmax_lse, None, None)``."""
    if (
        dropout_p
        or softcap
        or alibi_slopes is not None
        or window_size_left != -1
        or window_size_right not in (-1, 0)
    ):
        raise NotImplementedError("the CPU stand-in has no dropout, softcap, alibi or sliding window")
    with torch.no_grad():
        out, lse = _attend(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    return out, lse, None, None


def varlen_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
    deterministic=False, rng_state=None, zero_tensors=False,
):  # fmt: skip
    """``flash_attn_interface._flash_attn_varlen_backward``: writes ``dq``, ``dk``, ``dv``."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        recomputed, _ = _attend(*leaves, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        grads = torch.autograd.grad(recomputed, leaves, dout)
    for target, grad in zip((dq, dk, dv), grads, strict=True):
        target.copy_(grad)
    return None


def install() -> None:
    """Point ``ring_flash_attn``'s llama3 varlen attention (OpenRLHF's) at the stand-ins."""
    from openrlhf.models.ring_attn_utils import patch_transformers_for_ring_flash_attn

    patch_transformers_for_ring_flash_attn()
    from ring_flash_attn import llama3_flash_attn_varlen

    llama3_flash_attn_varlen._flash_attn_varlen_forward = varlen_forward
    llama3_flash_attn_varlen._flash_attn_varlen_backward = varlen_backward

    # A real run sets up one strategy per process; the tests build several trainers in one, and
    # ring_flash_attn's substitution refuses to wrap its own wrapper: substitute once.
    import ring_flash_attn

    substitute = ring_flash_attn.substitute_hf_flash_attn
    if not getattr(substitute, "forkrl_once", False):
        done = []

        def once(process_group, heads_k_stride):
            if not done:
                substitute(process_group, heads_k_stride)
                done.append(True)

        once.forkrl_once = True
        ring_flash_attn.substitute_hf_flash_attn = once


def use_ring(trainer, flash: bool = True) -> None:
    """A built stock trainer's actor as OpenRLHF runs it under ring attention: packed samples (each
    rank its slice) through ``flash_attention_2`` (``ring_flash_attn``'s, installed by the
    strategy); ``flash=False`` keeps sdpa, which sees only the rank's slice (a negative control)."""
    trainer.actor.packing_samples = True
    if flash:
        trainer.actor.model.module.config._attn_implementation = "flash_attention_2"
