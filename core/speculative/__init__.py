"""Self-speculative rollout: batched exact speculative sampling with a quantized copy of the policy.

- :mod:`.accept`: the acceptance math (rejection sampling, greedy verification) and logits warping.
- :mod:`.policy`: the cost model and :class:`SpeculationPolicy` (when to speculate, how far).
- :mod:`.hf`: :class:`SpeculativeSampler`, the Hugging Face engine (ragged caches, batching).
- :mod:`.stats`: :class:`SpeculativeStats` (the ``spec/*`` metrics) and :class:`SpeculativeOutput`.
- :mod:`.options`: :class:`SpeculativeOptions`, every host's flags, defined once.
- :mod:`.rollout`: :class:`SelfSpeculativeRollout`, the drafter kept in step with the policy.
- :mod:`.vllm_engine`: the vLLM engine: ``speculative_config`` for forkrl's drafter, forkrl's vLLM
  plugin (``vllm.general_plugins``) and :class:`~.vllm_engine.DrafterMirror`, which re-quantizes the
  drafter from the target's weights after every weight sync, inside vLLM's worker.
- :mod:`.vllm_quant`: forkrl's round-to-nearest quantization as vLLM quantization methods (imports vLLM).
"""

from ..quant import Drafter
from .accept import greedy_accept, speculative_accept, warp_logits
from .hf import SpeculativeSampler
from .options import SPECULATIVE_POLICIES, SpeculativeOptions
from .policy import DEFAULT_LADDER, CostModel, Decision, SpeculationPolicy, expected_tokens, predicted_speedup
from .rollout import SelfSpeculativeRollout
from .stats import METRIC_PREFIX, SpeculativeOutput, SpeculativeStats

__all__ = [
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
