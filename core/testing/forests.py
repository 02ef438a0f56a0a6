"""Batches of token sequences with the sharing patterns forkrl must handle."""

from __future__ import annotations

import torch

from ..tree import PrefixForest


def _rand(g, n, vocab):
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def grpo_group(vocab=61, seed=0, prompt=11, group=4, max_len=6):
    """One prompt, ``group`` completions of random lengths, one repeated completion."""
    g = torch.Generator().manual_seed(seed)
    p = _rand(g, prompt, vocab)
    seqs = [p + _rand(g, int(torch.randint(1, max_len + 1, (1,), generator=g)), vocab) for _ in range(group)]
    seqs.append(list(seqs[1]))
    return seqs, [prompt] * len(seqs)


def deep_tree(vocab=61, seed=1):
    """Shared system prompt across two groups, multi-turn trajectories, prefixes and duplicates."""
    g = torch.Generator().manual_seed(seed)
    system = _rand(g, 5, vocab)
    q1, q2 = system + _rand(g, 4, vocab), system + _rand(g, 3, vocab)
    turn1 = q1 + _rand(g, 3, vocab)
    seqs = [
        q1 + _rand(g, 4, vocab),
        q1 + _rand(g, 2, vocab),
        turn1 + _rand(g, 3, vocab),  # multi-turn: scored span starts late
        turn1 + _rand(g, 2, vocab) + _rand(g, 2, vocab),
        q2 + _rand(g, 5, vocab),
        q2 + _rand(g, 1, vocab),
        system + _rand(g, 2, vocab),
    ]
    seqs.append(list(seqs[4]))  # duplicate
    seqs.append(seqs[0][:-2])  # a prefix of another sequence
    score_from = [len(q1), len(q1), len(turn1), len(turn1) - 2, len(q2), len(q2), 5, len(q2), len(q1)]
    return seqs, score_from


def scored_shared(vocab=61, seed=2):
    """Scored spans that overlap shared tokens (a scored token owned by several sequences)."""
    g = torch.Generator().manual_seed(seed)
    p = _rand(g, 6, vocab)
    mid = _rand(g, 4, vocab)
    seqs = [p + mid + _rand(g, 3, vocab), p + mid + _rand(g, 2, vocab), p + _rand(g, 5, vocab), p[:3]]
    return seqs, [4, 2, 6, 1]


FORESTS = {"grpo": grpo_group, "deep": deep_tree, "scored_shared": scored_shared}


def late_scored_forest(
    seed: int, prompts: tuple[tuple[int, int, int], ...], vocab: int = 61
) -> tuple[PrefixForest, list[torch.Tensor], list[torch.Tensor]]:
    """A forest of several prompts, each ``(P, G, late)``: ``G`` responses of uneven lengths, every
    odd one scored from ``late`` tokens after its prompt; with float64 coefficients per scored token
    for log-probs and (a tenth the size) entropies.

    Returns:
        ``(forest, coefficients, entropy_coefficients)``, one ``[len_i - score_from_i]`` tensor per
        sequence in each list.
    """
    g = torch.Generator().manual_seed(seed)
    seqs, score_from = [], []
    for P, G, late in prompts:
        prompt = _rand(g, P, vocab)
        for i in range(G):
            seqs.append(prompt + _rand(g, 2 + (i * 3) % 5, vocab))
            score_from.append(P + (late if i % 2 else 0))
    forest = PrefixForest.build(seqs, score_from)
    sizes = [len(s) - f for s, f in zip(seqs, score_from, strict=True)]
    coefs = [torch.randn(n, generator=g, dtype=torch.float64) for n in sizes]
    ent_coefs = [0.1 * torch.randn(n, generator=g, dtype=torch.float64) for n in sizes]
    return forest, coefs, ent_coefs
