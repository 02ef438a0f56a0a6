"""forkrl for TRL: ``GRPOConfig``/``GRPOTrainer`` and ``RLOOConfig``/``RLOOTrainer`` subclasses.

    from forkrl.plugins.trl import GRPOConfig, GRPOTrainer
    trainer = GRPOTrainer(model, reward_funcs, args=GRPOConfig(..., tree_packing=True), train_dataset=ds)

- :mod:`.config`: TRL's configs plus forkrl's options (core's ``TreeOptions`` and
  ``SpeculativeOptions``) and the rules only TRL's settings decide.
- :mod:`.trainer`: the trainer subclasses, each holding a :class:`forkrl.core.train.TreeRunner`
  and, with ``speculative_rollout``, a :class:`~.speculative.TRLSpeculation`.
- :mod:`.host`: TRL's side of the tree loop (micro-batches to layouts, its loss on the leaves, DeepSpeed's
  hand-over, its metrics sink).
- :mod:`.balance`: ``tree_balance``, a window's rows moved between data-parallel ranks by tree cost.
- :mod:`.speculative`: ``speculative_rollout``: TRL's generation through forkrl's exact sampler,
  or its vLLM engine drafting with forkrl's drafter, and the ``spec/*`` figures.
- :mod:`.vllm_speculative`: ``speculative_rollout`` with ``use_vllm``: the colocated engine's
  config and the ``spec/*`` counters.
- :mod:`.vllm_serve`: ``trl vllm-serve`` with forkrl's drafter (server mode; needs vLLM).
- :mod:`.compat`: every TRL/accelerate private the plugin relies on, checked by the contract tests.

Needs TRL in the same environment (from a clone: ``pip install -e '.[trl]'``).
"""

try:
    import trl  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without TRL
    raise ImportError(
        "forkrl.plugins.trl needs TRL: pip install -e '.[trl]' in a forkrl clone (trl>=1.16,<1.17 and peft)"
    ) from err

from .config import GRPOConfig, RLOOConfig
from .trainer import GRPOTrainer, RLOOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "RLOOConfig", "RLOOTrainer"]
