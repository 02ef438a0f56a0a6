"""The ``hf_cpu`` rollout backend for veRL 0.9.1: Hugging Face ``generate`` in place of vLLM, for CPU
smoke runs (:mod:`forkrl.plugins.verl.cpu_run`) and forkrl's tests; not for training.

vLLM and SGLang do not serve on a CPU machine, and veRL's own ``HFRollout`` is in neither of its
rollout registries. veRL's rollout is a replica (``RolloutReplica``) that launches server actors,
which the agent loop calls token-in/token-out (``generate(prompt_ids, sampling_params, request_id,
...) -> TokenOutput``), plus a hybrid adapter (``BaseRollout``) inside each actor worker that the
trainer hands the updated weights to after every step (``update_weights``). This fills both
places with the least that works: one server actor holding a float32 Hugging Face copy of the
policy, sampling one request at a time with ``generate`` (veRL's temperature, top-p and top-k),
and an adapter that loads the full weights veRL streams to it after every update (veRL's naive
checkpoint backend gathers full tensors, a CPU path). It makes the rollouts; the training step,
stock veRL's or forkrl's, is untouched by it. Registered by :mod:`forkrl.plugins.verl.cpu_host`.
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from forkrl.core.compat import tied_weight_names

__all__ = ["HFReplica", "HFServer", "HFServerAdapter"]


def _server_name(replica_rank: int) -> str:
    return f"forkrl_hf_cpu_server_{replica_rank}_0"


class HFServer:
    """A Ray actor sampling with ``model.generate`` (float32, CPU), one request at a time."""

    def __init__(self, config, model_config, replica_rank: int) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        path = getattr(model_config, "local_path", None) or model_config.path
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.response_length = int(config.response_length)
        self.seed = int(config.seed) + replica_rank
        self.global_steps: int | None = None
        self.weight_syncs = 0
        # Sampling seeds: (prompt, how often it was asked since the last weight sync). A run resumed
        # from a checkpoint then samples what the uninterrupted run sampled at the same step.
        self.asked: dict[tuple[int, ...], int] = {}

    def ready(self) -> bool:
        return True

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **_: Any
    ) -> TokenOutput:
        """Token-in/token-out sampling with veRL's sampling parameters (temperature, top-p, top-k)."""
        params = dict(sampling_params)
        max_new = min(
            int(params.get("max_tokens", params.get("max_new_tokens", self.response_length))),
            self.response_length,
        )
        temperature = float(params.get("temperature", 1.0))
        top_k = int(params.get("top_k", -1))
        sample = temperature > 0
        kwargs = dict(do_sample=sample, max_new_tokens=max(1, max_new))
        if sample:
            kwargs.update(
                temperature=temperature,
                top_p=float(params.get("top_p", 1.0)),
                top_k=top_k if top_k > 0 else 0,
            )
        ids = torch.tensor([list(prompt_ids)])
        key = tuple(int(t) for t in prompt_ids)
        nth = self.asked.get(key, 0)
        self.asked[key] = nth + 1
        torch.manual_seed(hash((self.seed, key, nth)) & 0x7FFF_FFFF)  # requests run one at a time
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                return_dict_in_generate=True,
                output_logits=True,
                **kwargs,
            )
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        eos = self.model.generation_config.eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        for i, t in enumerate(tokens):  # up to and including the first EOS, as vLLM returns them
            if t in eos:
                tokens = tokens[: i + 1]
                break
        log_probs = None
        if params.get(
            "logprobs"
        ):  # the sampled tokens' log-probs at the temperature, as veRL's actor scores them
            logits = torch.cat(out.logits[: len(tokens)]).float() / (temperature if sample else 1.0)
            log_probs = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        self.sampled(prompt_ids, tokens)
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def sampled(self, prompt_ids: list[int], tokens: list[int]) -> None:
        """Called with every sample it returns (nothing here; a subclass may record them)."""

    def load_weights(self, state: dict[str, torch.Tensor], global_steps: int | None) -> int:
        """The policy's full weights after an update; every parameter must be covered."""
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = tied_weight_names(self.model)  # tied copies need no weights of their own
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise KeyError(
                f"weight sync does not match the rollout model: missing {missing}, unexpected {unexpected}"
            )
        self.global_steps = global_steps
        self.weight_syncs += 1
        self.asked.clear()
        return self.weight_syncs

    # The replica's control surface (vLLM's server has these): nothing to free or pause on a CPU.
    async def wake_up(self, tags: list[str] | None = None) -> None:
        pass

    async def sleep(self) -> None:
        pass

    async def abort_all_requests(self, reject_request: bool = False) -> dict:
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        pass

    async def clear_kv_cache(self) -> None:
        pass

    async def release_kv_cache(self) -> None:
        pass

    async def resume_kv_cache(self) -> None:
        pass

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def start_profile(self, **kwargs) -> None:
        pass

    async def stop_profile(self) -> None:
        pass


class HFReplica(RolloutReplica):
    """One :attr:`server_class` actor per replica (registered as the ``hf_cpu`` rollout)."""

    #: The server actor's class (a subclass of :class:`HFServer`).
    server_class: type = HFServer

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        server = (
            ray.remote(self.server_class)
            .options(name=_server_name(self.replica_rank), num_cpus=0, max_concurrency=self.max_concurrency)
            .remote(self.config, self.model_config, self.replica_rank)
        )
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = _server_name(self.replica_rank)


class HFServerAdapter(BaseRollout):
    """The hybrid side inside each actor worker: hands the trainer's weights to the replica's server."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        per_replica = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = int(os.environ.get("RANK", 0))
        self.replica_rank = rank // per_replica if replica_rank < 0 else replica_rank
        self.leader = rank % per_replica == 0

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass

    @torch.no_grad()
    async def update_weights(
        self, weights, global_steps: int | None = None, wire_format: str = "named_tensors", **_
    ):
        assert wire_format == "named_tensors", wire_format
        state = {}
        for name, tensor in weights:  # every rank consumes the stream (it may hold collectives)
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            state[name] = tensor.detach().to("cpu", torch.float32, copy=True)
        if self.leader:
            await ray.get_actor(_server_name(self.replica_rank)).load_weights.remote(state, global_steps)
