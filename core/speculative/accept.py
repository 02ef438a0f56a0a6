"""The acceptance math of speculative sampling, and the logits warping both models share.

Speculative rejection sampling (Leviathan et al., 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al., 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling") keeps a prefix of the drafter's proposals such that every emitted token is
distributed exactly as the target's, whatever the drafter is; the target and drafter
distributions must be warped identically (temperature, top-k, top-p) for that to hold.
"""

from __future__ import annotations

import math

import torch

__all__ = ["greedy_accept", "speculative_accept", "warp_logits"]


def warp_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Temperature, then top-k, then top-p, with the semantics of Hugging Face's logits warpers.

    Mirrors ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (with
    ``min_tokens_to_keep=1``) in the order ``generate`` applies them; ties at the k-th value are
    kept, and the top-p cut keeps the smallest set whose mass exceeds ``top_p``.

    Args:
        logits: ``[N, V]`` float logits (float32, as ``generate`` casts them).
        temperature: > 0; 1.0 is a no-op.
        top_k: keep the k largest (None or 0: off).
        top_p: nucleus mass in (0, 1] (None or 1.0: off).

    Returns:
        ``[N, V]`` warped logits, filtered entries set to ``-inf``.
    """
    scores = logits
    if temperature != 1.0:
        scores = scores / temperature
    if top_k:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cum <= (1 - top_p)
        sorted_remove[..., -1:] = False
        remove = sorted_remove.scatter(-1, sorted_idx, sorted_remove)
        scores = scores.masked_fill(remove, -math.inf)
    return scores


def speculative_accept(
    drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling over a batch (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

    For each row, draft token ``x_j`` (sampled from ``q_j``) is accepted with probability
    ``min(1, p_j(x_j) / q_j(x_j))``, left to right, until the first rejection. At a rejection at
    ``j`` the row's next token is drawn from the residual ``norm(max(0, p_j - q_j))``; if all ``k``
    drafts are accepted, a bonus token is drawn from ``p_{k+1}``. Each emitted token then has
    exactly the distribution ``p`` given its prefix, whatever ``q`` is.

    Args:
        drafts: ``[B, k]`` draft tokens, ``drafts[:, j] ~ q[:, j]``.
        q: ``[B, k, V]`` drafter probabilities the drafts were sampled from (warped, normalised).
        p: ``[B, k + 1, V]`` target probabilities at the same positions plus one (warped, normalised).
        generator: random source.

    Returns:
        ``(n_accepted [B], next_token [B])``: the row keeps ``drafts[:, :n]`` then ``next_token``.
    """
    bsz, k = drafts.shape
    p_x = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # [B, k]
    q_x = q.gather(-1, drafts[..., None])[..., 0]  # [B, k], > 0: x was sampled from q
    u = torch.rand(bsz, k, generator=generator, device=drafts.device, dtype=p.dtype)
    # u < p/q  <=>  u * q < p (no division; p(x) = 0 never accepts, p(x) >= q(x) always does).
    accept = u * q_x < p_x
    n = accept.to(torch.int64).cumprod(-1).sum(-1)  # [B] leading accepts
    rows = torch.arange(bsz, device=drafts.device)
    p_n = p[rows, n]  # [B, V]: p at the first rejected position, or p_{k+1} when all accepted
    q_n = q[rows, n.clamp(max=k - 1)]
    residual = (p_n - q_n).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # When everything was accepted, or p == q up to rounding (the residual vanishes), draw from p.
    use_p = (n == k)[:, None] | (mass <= 0)
    dist = torch.where(use_p, p_n, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny))
    next_token = torch.multinomial(dist, 1, generator=generator)[:, 0]
    return n, next_token


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: keep drafts while they equal the target's argmax.

    Args:
        drafts: ``[B, k]`` drafter argmax tokens.
        target_logits: ``[B, k + 1, V]`` float32 target logits at the draft positions plus one.

    Returns:
        ``(n_accepted [B], next_token [B])`` with next_token the target's argmax after the kept drafts.
    """
    best = target_logits.argmax(-1)  # [B, k + 1], first maximum on ties, as generate
    k = drafts.shape[1]
    n = (drafts == best[:, :k]).to(torch.int64).cumprod(-1).sum(-1)
    return n, best.gather(1, n[:, None])[:, 0]
