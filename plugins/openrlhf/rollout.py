"""``--forkrl.speculative_rollout``: OpenRLHF's vLLM engines draft with forkrl's quantized policy.

OpenRLHF's ``create_vllm_engines`` takes no extra engine arguments; each engine is a Ray actor
built as ``RolloutRayActor.options(...).remote(**actor_kwargs)`` whose keyword arguments become
vLLM's ``AsyncEngineArgs``. While the launcher runs, :class:`SpeculativeRolloutActor` stands in for
that class in ``vllm_engine``: an actor of OpenRLHF's class that adds forkrl's
``speculative_config`` (the engine's own model and tensor-parallel size) to each engine's arguments
and answers :meth:`spec_counters`. The drafter then follows every weight broadcast inside the
engine's workers (forkrl's vLLM plugin: ``WorkerWrap.update_weight`` ends in the target's
``load_weights``).

:func:`speculative_trainer` is OpenRLHF's driver-side ``PPOTrainer`` whose step metrics gain
``spec/acceptance``, ``spec/draft_len`` and ``spec/mean_accepted_length`` (vLLM's counters over the
step's rollout, all engines), beside OpenRLHF's own ``timing/generation``.
"""

from __future__ import annotations

from typing import Any

from forkrl.core.speculative import SpeculativeOptions
from forkrl.plugins.vllm.speculative import spec_counters, spec_decode_metrics, vllm_speculative_config

from . import compat

__all__ = ["SpeculativeRolloutActor", "speculative_trainer"]


def _engine_spec_counters(self: Any) -> dict[str, float]:
    """vLLM's speculative-decoding counters in this engine's process (its Prometheus metrics)."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    return spec_counters(get_metrics_snapshot())


class SpeculativeRolloutActor:
    """OpenRLHF's ``RolloutRayActor`` (a Ray actor class) with forkrl's speculative config added.

    Args:
        actor_class: OpenRLHF's ``RolloutRayActor`` (or a subclass's Ray actor class).
        options: forkrl's options (``speculative_rollout`` on, policy ``always``).
    """

    def __init__(self, actor_class: Any, options: SpeculativeOptions) -> None:
        self.actor_class = compat.with_methods(actor_class, __name__, spec_counters=_engine_spec_counters)
        self.speculative = options.speculative_options()

    def options(self, **ray_options: Any) -> _Bound:
        """Ray's ``ActorClass.options``: placement and resources, unchanged."""
        return _Bound(self.actor_class.options(**ray_options), self.speculative)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Ray's ``ActorClass.remote`` with the engine arguments completed."""
        return _Bound(self.actor_class, self.speculative).remote(*args, **kwargs)


class _Bound:
    def __init__(self, handle: Any, options: SpeculativeOptions) -> None:
        self.handle, self.options = handle, options

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if "speculative_config" in kwargs:
            raise ValueError(
                "the vLLM engine already has a speculative_config; forkrl's drafter would replace it"
            )
        spec = vllm_speculative_config(self.options, kwargs["model"], kwargs.get("tensor_parallel_size"))
        return self.handle.remote(*args, **kwargs, speculative_config=spec)


def speculative_trainer(trainer_class: Any) -> Any:
    """OpenRLHF's ``PPOTrainer`` (or the asynchronous trainer's ``TrainingActor``; a Ray actor class of
    a ``BasePPOTrainer``) logging ``spec/*`` each step.

    Its ``_compute_rollout_stats`` (run once per training step, on the step's rollout) adds
    :func:`~forkrl.plugins.vllm.speculative.spec_decode_metrics` of the engines' summed counters
    since the previous step (an evaluation's rollouts in between count toward the next step; with
    ``--train.async_enable``, whatever the engines drafted while the step trained).
    """
    import ray

    base = trainer_class.__ray_actor_class__

    def _compute_rollout_stats(self: Any, experiences: Any) -> dict:
        stats = base._compute_rollout_stats(self, experiences)
        counts = ray.get([engine.spec_counters.remote() for engine in self.vllm_engines])
        now = {k: sum(c[k] for c in counts) for k in counts[0]}
        stats.update(spec_decode_metrics(getattr(self, "_forkrl_spec_counters", {}), now))
        self._forkrl_spec_counters = now
        return stats

    return compat.with_methods(trainer_class, __name__, _compute_rollout_stats=_compute_rollout_stats)
