"""``speculative_rollout`` with ``use_vllm=True``: TRL's vLLM engine drafts with forkrl's quantized policy.

- colocate: the engine TRL builds in the trainer's process gets forkrl's ``speculative_config``
  (:func:`forkrl.plugins.vllm.speculative.vllm_speculative_config`, for the model and
  tensor-parallel size TRL passes) and ``disable_log_stats=False`` (vLLM counts drafts only then).
  With ``speculative_policy='auto'`` forkrl first times the policy and its drafter on this device
  (the cost model of the transformers path) and hands vLLM the draft length per batch size
  (``num_speculative_tokens_per_batch_size``, up to TRL's ``max_num_seqs``), fixed for the run;
  where speculation pays at no batch size, vLLM decodes plainly;
- server: TRL 1.16's ``trl vllm-serve`` runs vLLM's own server, so the speculative config is the
  server's: ``python -m forkrl.plugins.trl.vllm_serve`` starts it with forkrl's (:mod:`.vllm_serve`).

Either way the drafter is re-synced inside vLLM's worker after every ``sync_weights`` (forkrl's
vLLM plugin, :class:`~forkrl.plugins.vllm.speculative.DrafterMirror`); the trainer only reads
vLLM's counters around each generation into ``spec/*`` metrics (the server's through
:func:`forkrl.plugins.vllm.speculative.prometheus_counters`).
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable
from typing import Any

from torch import nn

from forkrl.core.speculative import SelfSpeculativeRollout
from forkrl.plugins.vllm.speculative import prometheus_counters, spec_counters, vllm_speculative_config

logger = logging.getLogger(__name__)

__all__ = ["colocate_engine_kwargs", "counters", "prometheus_counters"]

_CALIBRATION_PROMPT = 128


def colocate_engine_kwargs(config: Any, policy_model: Callable[[], nn.Module]) -> Callable[[dict], dict]:
    """The function adding forkrl's engine arguments to TRL's colocated ``LLM(**kwargs)``.

    Args:
        config: the trainer's forkrl config.
        policy_model: returns the trainer's policy model (read when the engine is built, for ``auto``).
    """

    def extra(kwargs: dict[str, Any]) -> dict[str, Any]:
        schedule = None
        if config.speculative_policy == "auto":
            schedule = calibrated_schedule(config, policy_model(), int(kwargs.get("max_num_seqs") or 256))
        spec = vllm_speculative_config(config, kwargs["model"], kwargs.get("tensor_parallel_size"), schedule)
        if spec is None:
            logger.warning(
                "speculative_rollout: forkrl's cost model predicts no gain from drafting at any batch size up to %s on "
                "this device; vLLM decodes plainly (speculative_policy='always' forces a draft length)",
                kwargs.get("max_num_seqs"),
            )
            return {}
        logger.info("speculative_rollout: vLLM drafts with %s", spec)
        return {"speculative_config": spec, "disable_log_stats": False}

    return extra


def calibrated_schedule(config: Any, model: nn.Module, max_batch: int) -> list[tuple[int, int, int]]:
    """Draft length per batch size from forkrl's cost model, timed on ``model`` and its drafter here."""
    rollout = SelfSpeculativeRollout(
        config,
        temperature=config.temperature,
        top_k=config.top_k or None,
        top_p=config.top_p,
        max_new_tokens=config.max_completion_length,
    )
    # TRL fixes no prompt length: time at _CALIBRATION_PROMPT tokens plus half the completion budget.
    policy = rollout.sampler(
        model, 0, [_CALIBRATION_PROMPT] * max_batch
    ).policy  # drafter dropped after timing
    schedule = policy.batch_schedule(max_batch)
    logger.info("speculative_rollout: draft length per batch size %s", schedule)
    return schedule


def counters(generation: Any) -> dict[str, float] | None:
    """The engine's counters now (colocate: ``llm.get_metrics()``; server: ``GET /metrics``); None if unreadable."""
    try:
        if getattr(generation, "mode", None) == "colocate":
            return spec_counters(generation.llm.get_metrics())
        client = generation.vllm_client
        with urllib.request.urlopen(f"{client.base_url}/metrics", timeout=5) as response:
            return prometheus_counters(response.read().decode())
    except Exception as err:  # metrics are best-effort: never fail a rollout over them
        logger.warning(
            "speculative_rollout: cannot read vLLM's counters (%s); no spec/* metrics this step", err
        )
        return None
