"""``--forkrl.speculative_rollout``: OpenRLHF's vLLM engines draft with forkrl's quantized policy.

OpenRLHF's ``create_vllm_engines`` takes no extra engine arguments; each engine is a Ray actor
built as ``RolloutRayActor.options(...).remote(**actor_kwargs)`` whose keyword arguments become
vLLM's ``AsyncEngineArgs``. While the launcher runs, :class:`SpeculativeRolloutActor` stands in for
that class in ``vllm_engine`` and adds forkrl's ``speculative_config`` (the engine's own model and
tensor-parallel size) to each engine's arguments. The drafter then follows every weight
broadcast inside the engine's workers (forkrl's vLLM plugin: ``WorkerWrap.update_weight`` ends in
the target's ``load_weights``); vLLM logs the acceptance rate with its engine statistics.
"""

from __future__ import annotations

from typing import Any

from forkrl.core.speculative import SpeculativeOptions
from forkrl.core.speculative.vllm_engine import vllm_speculative_config

__all__ = ["SpeculativeRolloutActor"]


class SpeculativeRolloutActor:
    """OpenRLHF's ``RolloutRayActor`` (a Ray actor class) with forkrl's speculative config added.

    Args:
        actor_class: OpenRLHF's ``RolloutRayActor``.
        options: forkrl's options (``speculative_rollout`` on, policy ``always``).
    """

    def __init__(self, actor_class: Any, options: SpeculativeOptions) -> None:
        self.actor_class, self.speculative = actor_class, options.speculative_options()

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
