"""The tree executor: a causal LM run depth-first over a prefix forest.

- :mod:`.tree_executor`: :class:`TreeExecutor`, the public API (``score``, ``backward``).
- :mod:`.dfs`: the depth-first pass, a state machine of named steps (keep and replay modes).
- :mod:`.packed`: packed mode (one sequence with a tree attention mask).
- :mod:`.head`: the LM head at scored rows, and the coefficients a gradient pass applies.
- :mod:`.model`: the model adapter (decoder / LM head split, cache kinds, switches).
- :mod:`.cache`: the per-node caches and what a node leaves in them.
- :mod:`.scan`: Mamba-1's selective scan from a parent's state.
- :mod:`.context_parallel`: long-context replay with the prompt's cache split over ranks (its
  parallel schedule in :mod:`.cp_rounds`); :mod:`.cp_executor`: a forest's prompts split so.
- :mod:`.vision`: images in a tree (each unique image through the vision tower once).
"""

from ..tree import Unit, plan
from .context_parallel import ContextParallelReplay, ContextParallelResult
from .cp_executor import ContextParallelExecutor
from .head import CoefficientFn
from .model import ModelAdapter, UnsupportedModelError
from .router import RouterLoss
from .tree_executor import MODES, PROMPT_GRADS, ExecMode, PromptGrad, ScoreResult, TreeExecutor
from .vision import Image, VisionBatch, images_from

__all__ = [
    "MODES",
    "PROMPT_GRADS",
    "CoefficientFn",
    "ContextParallelExecutor",
    "ContextParallelReplay",
    "ContextParallelResult",
    "ExecMode",
    "Image",
    "ModelAdapter",
    "PromptGrad",
    "RouterLoss",
    "ScoreResult",
    "TreeExecutor",
    "Unit",
    "UnsupportedModelError",
    "VisionBatch",
    "images_from",
    "plan",
]
