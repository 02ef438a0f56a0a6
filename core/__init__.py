"""forkrl core: exact prefix-tree training of causal LMs. Imports torch and transformers only.

Packages, each split by the axis it grows on:

- :mod:`.tree`: :class:`PrefixForest`, the execution plan, host row layouts (:class:`RowLayout`).
- :mod:`.executor`: :class:`TreeExecutor` (depth-first keep/replay, packed), model adapter, caches.
- :mod:`.attention`: attention backends behind one selector (CPU split attention, tree masks).
- :mod:`.objective`: the bridge from a host's own loss on leaf tensors to the exact gradient.
- :mod:`.train`: the host-neutral training step every plugin calls, and :class:`TreeOptions`.
- :mod:`.balance`: tree-aware data-parallel balancing (cost model fitted to timings, the plan,
  rows moved between ranks).
- :mod:`.estimate`: what tree training would save on a user's prompts (``python -m forkrl estimate``).
- :mod:`.speculative`: self-speculative rollout (acceptance math, policy and cost model, the
  Hugging Face engine, stats, :class:`~forkrl.core.speculative.SpeculativeOptions`).
- :mod:`.quant`: weight-only int4/int8 linear layers and the self-drafter.
- :mod:`.compat`: every transformers/torch private core relies on, with the version checked.
- :mod:`.options`: typed option dataclasses and the flags hosts derive from them.
- :mod:`.testing`: float64 mode, memory meters, tiny model builders (tests, benchmarks, examples).
"""

from .errors import UnsupportedModelError
from .executor import ScoreResult, TreeExecutor
from .objective import ObjectiveResult, WindowResult, backward_loss, backward_window
from .train import StepMetrics, TreeOptions, TreeStep
from .tree import PrefixForest, RowLayout, TreeNode, Window

__all__ = [
    "ObjectiveResult",
    "PrefixForest",
    "RowLayout",
    "ScoreResult",
    "StepMetrics",
    "TreeExecutor",
    "TreeNode",
    "TreeOptions",
    "TreeStep",
    "UnsupportedModelError",
    "Window",
    "WindowResult",
    "backward_loss",
    "backward_window",
]
