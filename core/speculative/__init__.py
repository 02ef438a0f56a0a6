"""Self-speculative rollout: batched exact speculative sampling with a quantized copy of the policy.

- :mod:`.accept`: the acceptance math (rejection sampling, greedy verification) and logits warping.
- :mod:`.policy`: the cost model and :class:`SpeculationPolicy` (when to speculate, how far).
- :mod:`.hf`: :class:`SpeculativeSampler`, the Hugging Face engine (the speculative loop, batching).
- :mod:`.ragged`: the ragged-batch forward it runs (fixed-capacity caches, a write column per row)
  and its timing for the cost model.
- :mod:`.stats`: :class:`SpeculativeStats` (the ``spec/*`` metrics) and :class:`SpeculativeOutput`.
- :mod:`.options`: :class:`SpeculativeOptions`, every host's flags, defined once.
- :mod:`.rollout`: :class:`SelfSpeculativeRollout`, the drafter kept in step with the policy.

vLLM's ``speculative_config`` for forkrl's drafter and the ``spec/*`` figures from vLLM's counters
are the vLLM plugin's (:mod:`forkrl.plugins.vllm.speculative`), beside the quantization as vLLM
methods and the drafter re-synced after each weight load.
"""

from ..quant import Drafter
from .accept import greedy_accept, speculative_accept, warp_logits
from .hf import SpeculativeSampler
from .options import SPECULATIVE_POLICIES, SpeculativeOptions
from .policy import DEFAULT_LADDER, CostModel, Decision, SpeculationPolicy, expected_tokens, predicted_speedup
from .rollout import SelfSpeculativeRollout, check_drafter
from .stats import METRIC_PREFIX, SpeculativeOutput, SpeculativeStats

__all__ = [
    "check_drafter",
    "DEFAULT_LADDER",
    "METRIC_PREFIX",
    "SPECULATIVE_POLICIES",
    "CostModel",
    "Decision",
    "Drafter",
    "SelfSpeculativeRollout",
    "SpeculationPolicy",
    "SpeculativeOptions",
    "SpeculativeOutput",
    "SpeculativeSampler",
    "SpeculativeStats",
    "expected_tokens",
    "greedy_accept",
    "predicted_speedup",
    "speculative_accept",
    "warp_logits",
]
