"""forkrl core: exact prefix-tree training of causal LMs. Imports torch and transformers only."""

from .executor import ScoreResult, TreeExecutor
from .models import UnsupportedModelError
from .tree import PrefixForest, TreeNode

__all__ = ["PrefixForest", "ScoreResult", "TreeExecutor", "TreeNode", "UnsupportedModelError"]
