"""Pearson chi-square tests for the samplers' statistical checks (the exact samplers must follow the
policy's distribution): goodness of fit to known probabilities, and two samples from one
distribution. Cells whose expected count is under 5 are pooled into one, as the test requires."""

from __future__ import annotations

import torch

__all__ = ["chi_square_pvalue", "homogeneity_pvalue"]


def _pvalue(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution with ``df`` degrees of freedom at ``stat``."""
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of ``counts`` [cells] to ``probs`` [cells]; 0 when a sample falls where the
    model puts zero probability."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    if bool((obs[~keep] > 0).any()):
        return 0.0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return _pvalue(stat, int(keep.sum()) - 1)


def homogeneity_pvalue(a: list[list[int]], b: list[list[int]]) -> float:
    """That two samples of token sequences come from one distribution."""
    cells = sorted({tuple(x) for x in a} | {tuple(x) for x in b})
    index = {c: i for i, c in enumerate(cells)}
    counts = torch.zeros(2, len(cells), dtype=torch.float64)
    for row, sample in enumerate((a, b)):
        for x in sample:
            counts[row, index[tuple(x)]] += 1
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    small = (expected < 5).any(0)
    obs = torch.cat([counts[:, ~small], counts[:, small].sum(1, keepdim=True)], 1)
    exp = torch.cat([expected[:, ~small], expected[:, small].sum(1, keepdim=True)], 1)
    keep = exp[0] > 0
    stat = float(((obs[:, keep] - exp[:, keep]) ** 2 / exp[:, keep]).sum())
    return _pvalue(stat, int(keep.sum()) - 1)
