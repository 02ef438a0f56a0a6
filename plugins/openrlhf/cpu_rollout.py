"""The CPU run's rollout: a Hugging Face ``generate`` actor standing in for OpenRLHF 0.11.2's vLLM engines.

This module is the one seam between :mod:`~forkrl.plugins.openrlhf.cpu_run` and the rollout: a real
vLLM CPU rollout replaces it by providing the same two names,

- :func:`create_engines`: ``openrlhf.trainer.ray.create_vllm_engines``'s signature, swapped in on
  the driver while the run lasts;
- :data:`WORKER_PATCHES`: how the policy's weights reach the engines after each step, applied in
  every Ray worker (with the device patches of :mod:`~forkrl.plugins.openrlhf.cpu_patches`).

Why a stand-in: OpenRLHF has no rollout without vLLM (``--vllm.num_engines 0`` still dispatches to
engines), and OpenRLHF 0.11.2's vLLM engines wait for GPUs, allocate their weight-sync buffers on
CUDA and sync weights over NCCL. OpenRLHF's driver builds its engines with ``create_vllm_engines``
and then only calls methods on them: the ``SamplesGenerator`` calls ``generate_responses`` and
``get_num_unfinished_requests``; OpenRLHF's own ``SingleTurnAgentExecutor`` calls back
``generate(prompt_token_ids, sampling_params)`` and reads ``.outputs[0].token_ids / .text /
.finish_reason / .logprobs`` as from a vLLM ``RequestOutput`` (log-probs are asked for only with
``--algo.advantage.is_correction_level``, which the CPU run refuses); sleep/wake/prefix-cache calls
come with ``--vllm.enable_sleep`` and prefix caching. :class:`HFRolloutActor` answers each of these
(Ray forbids subclassing ``RolloutRayActor``). Rewards are computed by OpenRLHF's own executor,
exactly as inside ``RolloutRayActor.generate_responses``.

It only makes rollouts: the policy's log-probs, advantages, loss, gradients and optimizer step are
the trainer's (stock OpenRLHF's or forkrl's), which receives the samples as from vLLM.

Its rollouts are a function of the weights and the prompts alone, so that a run resumed from a
checkpoint samples what the uninterrupted run sampled: each sample draws from its own seed (the
engine's seed, the prompt's tokens, and how often that prompt was asked since the last weight load),
not from one stream shared by whatever ran before; and requests run one at a time in the order they
were sent (a synchronous Ray actor), so OpenRLHF collects the prompts' results in one order.
Each request prints ``cpu rollout: N samples of '<prompt>' from load #K`` (``#0``: the initial
weights); with :data:`ROLLOUT_LOG` set, every sample is appended to that file as a JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType, SimpleNamespace
from typing import Any

import ray
import torch

__all__ = ["ROLLOUT_LOG", "WORKER_PATCHES", "HFRolloutActor", "create_engines"]

#: When this environment variable names a file, the rollout appends each sample it makes to it, one
#: JSON line ``{"load", "prompt", "tokens"}`` (``load``: the weight syncs it has had), e.g. to
#: compare two runs' rollouts step by step.
ROLLOUT_LOG = "FORKRL_CPU_ROLLOUT_LOG"


def _record(load: int, prompt: list[int], tokens: list[int]) -> None:
    path = os.environ.get(ROLLOUT_LOG)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"load": load, "prompt": list(prompt), "tokens": list(tokens)}) + "\n")


async def _ready(value: Any) -> Any:
    """``value``, awaitable: what the executor awaits from ``generate``, computed before it awaits."""
    return value


@ray.remote
class HFRolloutActor:
    """A Ray actor sampling with ``model.generate`` (float32, CPU), one request at a time.

    Synchronous (no ``async def`` method): Ray runs a synchronous actor's calls one at a time, each
    caller's in the order it sent them. An async actor would interleave two prompts' requests around
    the executor's reward threads, and OpenRLHF takes the prompts' results in the order they finish.
    """

    def __init__(
        self, pretrain: str, seed: int, agent_func_path: str | None = None, remote_rm_url: Any = None
    ) -> None:
        from openrlhf.utils.agent import SingleTurnAgentExecutor
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.seed = seed
        self.asked: Counter[tuple[int, ...]] = Counter()  # requests per prompt since the last load
        self.loads = 0
        self.model = AutoModelForCausalLM.from_pretrained(pretrain, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(pretrain)
        if agent_func_path:  # as RolloutRayActor chooses its executor
            from openrlhf.trainer.ray.vllm_engine import _load_agent_executor

            self.executor = _load_agent_executor(agent_func_path)
        else:
            self.executor = SingleTurnAgentExecutor(remote_rm_url)

    def generate(
        self, prompt_token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None
    ) -> Awaitable[Any]:
        """One sample for ``prompt_token_ids`` under vLLM ``sampling_params``, shaped like vLLM's
        ``RequestOutput`` (the fields OpenRLHF's executors read), for the executor to await.

        Sampled here, in the call, from the seed ``hash((seed, prompt tokens, n))`` for the prompt's
        ``n``-th request since the last :meth:`load_weights` (a tuple of ints hashes the same in
        every process): the same weights and prompts give the same samples in any run. Not a
        coroutine function, which would make Ray run the actor as an async one.
        """
        p = sampling_params
        if multi_modal_data or p.logprobs is not None:
            raise NotImplementedError(
                "the CPU rollout is text-only and returns no log-probs "
                "(keep --algo.advantage.is_correction_level off)"
            )
        sample = p.temperature > 0
        kwargs: dict[str, Any] = dict(
            do_sample=sample, max_new_tokens=p.max_tokens, min_new_tokens=p.min_tokens or 0
        )
        if sample:  # vLLM's top_k <= 0 means off, as HF's top_k=0
            kwargs.update(temperature=p.temperature, top_p=p.top_p, top_k=max(p.top_k or 0, 0))
        key = tuple(prompt_token_ids)
        torch.manual_seed(hash((self.seed, key, self.asked[key])) & 0x7FFFFFFF)
        self.asked[key] += 1
        ids = torch.tensor([prompt_token_ids])
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
                **kwargs,
            )
        tokens = out[0, ids.shape[1] :].tolist()
        _record(self.loads, prompt_token_ids, tokens)
        finished = bool(tokens) and tokens[-1] == self.tokenizer.eos_token_id
        text = self.tokenizer.decode(tokens, skip_special_tokens=p.skip_special_tokens)
        output = SimpleNamespace(
            token_ids=tokens, text=text, finish_reason="stop" if finished else "length", logprobs=None
        )
        return _ready(SimpleNamespace(prompt_token_ids=prompt_token_ids, outputs=[output]))

    def generate_responses(
        self,
        prompt: str,
        label: str,
        sampling_params: Any,
        max_length: int,
        hf_tokenizer: Any,
        num_samples: int = 1,
        images: Any = None,
    ) -> list[dict]:
        """``num_samples`` samples for one prompt, through OpenRLHF's executor (as ``RolloutRayActor``),
        sampled in order (the executor's tasks reach :meth:`generate` in the order they were made).

        Prints which weight load it samples from (``load #0`` is the initial model), for tests.
        """
        print(f"cpu rollout: {num_samples} samples of {prompt!r} from load #{self.loads}", flush=True)
        responses = self._responses(
            num_samples,
            prompt=prompt,
            label=label,
            sampling_params=sampling_params,
            max_length=max_length,
            hf_tokenizer=hf_tokenizer,
            images=images,
        )
        with ThreadPoolExecutor(1) as thread:  # a loop of its own: Ray's worker thread may run one
            return thread.submit(asyncio.run, responses).result()

    async def _responses(self, num_samples: int, **execute: Any) -> list[dict]:
        tasks = [self.executor.execute(llm_engine=self, **execute) for _ in range(num_samples)]
        return await asyncio.gather(*tasks)

    def get_num_unfinished_requests(self) -> int:
        """Requests run one at a time and finish inside their call: none is ever pending."""
        return 0

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy the policy's parameters (by name, any dtype) into the sampling model; all names must match.
        Restarts the per-prompt request counts that seed the samples."""
        params = dict(self.model.named_parameters())
        missing = set(params) - set(state)
        extra = set(state) - set(params)
        if missing or extra:
            raise KeyError(
                f"weight sync names differ: missing {sorted(missing)[:4]}, extra {sorted(extra)[:4]}"
            )
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state[name])
        self.asked.clear()
        self.loads += 1

    # vLLM memory management and prefix caching: nothing to do for an HF model.
    def sleep(self, level: int = 1) -> None:
        """No-op (vLLM frees its memory here)."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """No-op (vLLM reloads its memory here)."""

    def reset_prefix_cache(self) -> None:
        """No-op (no prefix cache)."""

    def pause_generation(self) -> None:
        """No-op (requests are never left running)."""

    def resume_generation(self) -> None:
        """No-op (requests are never left running)."""


def create_engines(
    num_engines: int,
    tensor_parallel_size: int,
    pretrain: str,
    seed: int,
    *args: Any,
    agent_func_path: str | None = None,
    remote_rm_url: Any = None,
    max_images_per_prompt: int = 0,
    **kwargs: Any,
) -> list:
    """``create_vllm_engines``'s signature: ``num_engines`` :class:`HFRolloutActor` (seeds ``seed + i``,
    as vLLM's), holding no Ray CPU or GPU (they take turns with the trainer on the same cores).
    The vLLM-only arguments (prefix caching, memory, placement, sleep, logprobs mode) are ignored."""
    if tensor_parallel_size != 1 or max_images_per_prompt:
        raise NotImplementedError("the CPU rollout is one text-only process per engine")
    return [
        HFRolloutActor.options(num_cpus=0, num_gpus=0).remote(
            pretrain, seed + i, agent_func_path=agent_func_path, remote_rm_url=remote_rm_url
        )
        for i in range(num_engines)
    ]


# ---------------------------------------------------------------------------------- weight sync
def broadcast_through_ray(module: ModuleType) -> None:
    """The policy's weights reach the rollout as a state dict through Ray instead of an NCCL broadcast.

    Replaces ``ActorPPOTrainer._init_vllm_sync_group`` (a PyNccl group between DeepSpeed rank 0 and the
    vLLM workers) with nothing, and ``ActorPPOTrainer.broadcast_to_vllm`` (parameter by parameter over
    that group) with one call of the rollout's ``load_weights``. forkrl's trainer inherits both. Why
    not the math: the same parameters (gathered under ZeRO-3, as OpenRLHF gathers them) reach the
    rollout after every step, as OpenRLHF sends them; the training step never reads them back.
    """
    import deepspeed
    import torch.distributed as dist

    def _init_vllm_sync_group(self: Any, backend: str) -> None:
        del self, backend

    def broadcast_to_vllm(self: Any) -> None:
        params = list(self.actor.model.module.named_parameters())
        zero3 = self.strategy.args.ds.zero_stage == 3
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=zero3):  # collective
            state = {n: p.detach().to("cpu", copy=True) for n, p in params} if dist.get_rank() == 0 else None
        if state is not None:
            ray.get([engine.load_weights.remote(state) for engine in self.vllm_engines])
        dist.barrier()

    module.ActorPPOTrainer._init_vllm_sync_group = _init_vllm_sync_group
    module.ActorPPOTrainer.broadcast_to_vllm = broadcast_to_vllm


#: module -> its patch, run in every Ray worker right after the module is first imported there.
WORKER_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "openrlhf.trainer.ray.ppo_actor": broadcast_through_ray,
}
