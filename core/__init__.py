"""forkrl core: exact prefix-tree training of causal LMs. Imports torch and transformers only."""

from .executor import ScoreResult, TreeExecutor
from .models import UnsupportedModelError
from .objective import ObjectiveResult, backward_loss
from .tree import PrefixForest, TreeNode

__all__ = [
    "ObjectiveResult",
    "PrefixForest",
    "ScoreResult",
    "TreeExecutor",
    "TreeNode",
    "UnsupportedModelError",
    "backward_loss",
]
