"""What a piece of a forest costs to train, predicted from its shape, with a model fitted to timings.

A piece is a set of root-to-leaf paths of one tree (a GRPO group, a multi-turn tree, or part of one);
training it computes the union of its paths' nodes once. Three figures describe that work:

- ``tokens``: unique tokens (linear layers, MLP, head: cost per token);
- ``attended``: query-key pairs of causal attention over the piece, ``sum_nodes L * start + L * (L + 1) / 2``
  for a node of ``L`` tokens starting at absolute position ``start`` (each query attends its ancestors);
- ``units``: nodes (per-forward/backward overhead);
- ``scored``: tokens whose log-prob is computed (the LM head runs only there: with a large
  vocabulary and a small model it is most of the step).

:class:`CostModel` predicts seconds as ``per_token * tokens + per_attended * attended + per_unit * units
+ per_scored * scored``,
with non-negative coefficients fitted by least squares to measured (shape, seconds) pairs
(:meth:`CostModel.fit`): on the machine at start or from the first steps, not guessed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["CostModel", "OnlineCostModel", "PieceStats"]


@dataclass(frozen=True)
class PieceStats:
    """Shape figures of one piece (or a sum of pieces)."""

    tokens: float = 0.0
    attended: float = 0.0
    units: float = 0.0
    scored: float = 0.0

    def __add__(self, other: PieceStats) -> PieceStats:
        return PieceStats(
            self.tokens + other.tokens,
            self.attended + other.attended,
            self.units + other.units,
            self.scored + other.scored,
        )

    def features(self) -> tuple[float, float, float, float]:
        return (self.tokens, self.attended, self.units, self.scored)


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of a piece: a non-negative linear model of its :class:`PieceStats`.

    The default (one unit of cost per token) is the token-count model a host without timings uses.
    """

    per_token: float = 1.0
    per_attended: float = 0.0
    per_unit: float = 0.0
    per_scored: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_token", "per_attended", "per_unit", "per_scored"):
            value = getattr(self, name)
            if not (value >= 0.0 and value < float("inf")):
                raise ValueError(f"CostModel.{name}={value!r} must be a finite number >= 0")

    def predict(self, stats: PieceStats) -> float:
        return (
            self.per_token * stats.tokens
            + self.per_attended * stats.attended
            + self.per_unit * stats.units
            + self.per_scored * stats.scored
        )

    @classmethod
    def fit(cls, shapes: Sequence[PieceStats], seconds: Sequence[float]) -> CostModel:
        """Least squares with non-negative coefficients (features with a negative coefficient are
        dropped and the rest refitted, until all are >= 0).

        Raises:
            ValueError: with fewer samples than features, or non-finite or negative timings.
        """
        if len(shapes) != len(seconds) or len(shapes) < 4:
            raise ValueError(
                f"CostModel.fit needs at least 4 (shape, seconds) pairs of equal count, got {len(shapes)}"
            )
        y = torch.tensor([float(s) for s in seconds], dtype=torch.float64)
        if not torch.isfinite(y).all() or (y < 0).any():
            raise ValueError("CostModel.fit: timings must be finite and >= 0")
        x = torch.tensor([s.features() for s in shapes], dtype=torch.float64)
        scale = x.abs().amax(0).clamp(min=1e-30)  # conditioning: features differ by orders of magnitude
        active = [j for j in range(x.shape[1]) if float(scale[j]) > 1e-30]
        coef = torch.zeros(x.shape[1], dtype=torch.float64)
        while active:
            sol = torch.linalg.lstsq(x[:, active] / scale[active], y[:, None]).solution[:, 0] / scale[active]
            if (sol >= 0).all():
                coef[active] = sol
                break
            active = [j for j, c in zip(active, sol.tolist(), strict=True) if c > 0]
        return cls(*(float(c) for c in coef))


class OnlineCostModel:
    """A :class:`CostModel` fitted to the steps trained so far: every rank's (shape, seconds) of each
    step, gathered so every rank fits the same model (the balancer's plan must agree across ranks).

    Until ``min_samples`` samples are in (and while a fit fails), :attr:`model` is ``default``. The
    fit uses the newest ``max_samples`` samples, so the model follows a run whose costs drift.

    Args:
        min_samples: samples before the first fit (at least 4, the model's features).
        max_samples: samples kept.
        default: the model before the first fit.
    """

    def __init__(self, min_samples: int = 8, max_samples: int = 64, default: CostModel | None = None) -> None:
        if not 4 <= min_samples <= max_samples:
            raise ValueError(f"need 4 <= min_samples <= max_samples, got {min_samples}, {max_samples}")
        self.min_samples, self.max_samples = min_samples, max_samples
        self.default = default or CostModel()
        self.samples: list[tuple[PieceStats, float]] = []
        self._fitted: CostModel | None = None

    def observe(self, stats: PieceStats, seconds: float, group=None) -> list[float]:
        """Add this rank's step (its pieces' summed shape and measured seconds); a collective when
        ``torch.distributed`` is initialised: every rank of ``group`` calls it once per step.

        Returns:
            every rank's measured seconds of this step, in rank order.
        """
        import torch.distributed as dist

        mine = (stats.features(), float(seconds))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            gathered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, mine, group=group)
        else:
            gathered = [mine]
        self.samples.extend((PieceStats(*f), s) for f, s in gathered)
        del self.samples[: -self.max_samples]
        self._fitted = None
        return [s for _, s in gathered]

    @property
    def fitted(self) -> bool:
        """Whether :attr:`model` is fitted to samples (else it is ``default``)."""
        return self.model is not self.default

    @property
    def model(self) -> CostModel:
        """The model fitted to the kept samples, or ``default`` before ``min_samples``."""
        if self._fitted is None:
            self._fitted = self.default
            if len(self.samples) >= self.min_samples:
                try:
                    fit = CostModel.fit([s for s, _ in self.samples], [t for _, t in self.samples])
                    if fit.predict(PieceStats(1.0, 1.0, 1.0, 1.0)) > 0:  # all-zero: no signal yet
                        self._fitted = fit
                except ValueError:
                    pass
        return self._fitted
