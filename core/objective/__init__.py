"""Objective bridge: a host's own loss on leaf tensors -> the exact gradient through the executor.

- :mod:`.bridge`: :func:`backward_window` (one optimizer step's micro-batches in the host's
  layout, three coefficient paths) and :func:`backward_loss` (one padded batch).
- :mod:`.window`: the loss over a window evaluated on flat leaves, its gradient and probe points.
- :mod:`.token_local`: coefficients formed during the pass for token-local losses.
"""

from .bridge import (
    LOSS_GRADIENTS,
    LossFn,
    LossGradient,
    ObjectiveResult,
    WindowResult,
    backward_loss,
    backward_window,
    pad,
    unpad,
)
from .token_local import TokenLocalCoefficients
from .window import Quiet, WindowLoss

__all__ = [
    "LOSS_GRADIENTS",
    "LossFn",
    "LossGradient",
    "ObjectiveResult",
    "Quiet",
    "TokenLocalCoefficients",
    "WindowLoss",
    "WindowResult",
    "backward_loss",
    "backward_window",
    "pad",
    "unpad",
]
