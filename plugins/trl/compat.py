"""Every TRL, transformers-Trainer and accelerate private the TRL plugin relies on, in one place.

Each :class:`HostPrivate` names a method the plugin overrides or calls, or an attribute it reads or
writes, with the reason; ``tests/trl/test_trl_contract.py`` checks every entry against the
installed TRL (signatures with ``inspect.signature``, instance attributes by the trainer's source),
so an upgrade that changes one fails in one test with the entry's name. The accessors below are the
plugin's only way to underscore attributes.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHECKED",
    "PRIVATES",
    "HostPrivate",
    "add_step_time",
    "advance_micro_step",
    "check",
    "deepspeed_config",
    "deepspeed_engine",
    "metrics",
    "scratch_metrics",
    "sync_gradients",
    "unwrap_for_generation",
]

CHECKED = "trl 1.16.0, transformers 5.25.0, accelerate 1.15.0"


@dataclass(frozen=True)
class HostPrivate:
    """One private of the host.

    Attributes:
        owner: ``"trainer"`` (both GRPOTrainer and RLOOTrainer), ``"GRPOTrainer"``, ``"accelerate"``,
            ``"trl"`` (a module-level function).
        name: the method or attribute.
        why: what the plugin does with it.
        params: for a method, its leading parameter names (the plugin passes these by position).
        attribute: an instance attribute (checked in the class's source), not a method.
    """

    owner: str
    name: str
    why: str
    params: tuple[str, ...] | None = None
    attribute: bool = False


PRIVATES: tuple[HostPrivate, ...] = (
    HostPrivate(
        "trainer",
        "__init__",
        "forkrl's keyword shortcut binds TRL's own parameters (it takes no **kwargs)",
        ("self", "model", "reward_funcs", "args"),
    ),
    HostPrivate(
        "trainer",
        "training_step",
        "overridden: collects the micro-batches of one optimizer step",
        ("self", "model", "inputs", "num_items_in_batch"),
    ),
    HostPrivate(
        "trainer",
        "_prepare_inputs",
        "called: TRL's generation, rewards and advantages, unchanged",
        ("self", "generation_batch"),
    ),
    HostPrivate(
        "trainer",
        "compute_loss",
        "called per micro-batch on the tree's leaves",
        ("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
    ),
    HostPrivate(
        "trainer",
        "_compute_loss",
        "compared: the fused pass trusts only TRL's own loss code",
        ("self", "model", "inputs"),
    ),
    HostPrivate(
        "trainer",
        "_get_per_token_logps_and_entropies",
        "overridden: serves the leaves inside the loss and tree-scores no-grad calls (old/ref log-probs)",
        (
            "self",
            "model",
            "input_ids",
            "attention_mask",
            "logits_to_keep",
            "batch_size",
            "compute_entropy",
            "compute_aux_loss",
        ),
    ),
    HostPrivate(
        "trainer",
        "_generate_single_turn",
        "overridden (speculative_rollout): TRL's transformers generation",
        ("self", "prompt_ids", "images", "multimodal_fields"),
    ),
    HostPrivate(
        "trainer",
        "_metrics",
        "the metrics sink (mode -> name -> list), and swapped out during probes",
        attribute=True,
    ),
    HostPrivate(
        "trainer", "_step", "counted per micro-batch as TRL's own training_step does", attribute=True
    ),
    HostPrivate("trainer", "_current_train_step_time", "TRL's step_time metric", attribute=True),
    HostPrivate(
        "trainer",
        "loss_is_scaled_for_ga",
        "whether the loss is already divided by the accumulation steps",
        attribute=True,
    ),
    HostPrivate(
        "trainer", "aux_loss_enabled", "MoE router loss on: the tree adds its gradient", attribute=True
    ),
    HostPrivate(
        "trainer",
        "router_aux_loss_coef",
        "the MoE router loss's coefficient (its weight per micro-batch)",
        attribute=True,
    ),
    HostPrivate(
        "trainer",
        "_is_vlm",
        "vision-language models: the families of forkrl.core.executor.vision on the tree, others refused",
        attribute=True,
    ),
    HostPrivate(
        "trainer", "_tokenizer", "pad id for the speculative sampler's left-padded prompts", attribute=True
    ),
    HostPrivate("trainer", "eos_token_ids", "EOS ids for the speculative sampler", attribute=True),
    HostPrivate(
        "GRPOTrainer", "off_policy_mask_threshold", "a value-dependent mask: no fused pass", attribute=True
    ),
    HostPrivate(
        "GRPOTrainer", "top_entropy_quantile", "a value-dependent mask: no fused pass", attribute=True
    ),
    HostPrivate(
        "accelerate",
        "GradientState._set_sync_gradients",
        "set per micro-batch so TRL's once-per-step loss work (adaptive entropy) runs once",
    ),
    HostPrivate("trl", "trl.models.unwrap_model_for_generation", "the model the speculative sampler drives"),
    HostPrivate(
        "VLLMGeneration",
        "_init_vllm",
        "colocate mode builds `self.llm = LLM(` from the module global LLM: swapped to add the speculative config",
    ),
    HostPrivate(
        "VLLMGeneration", "llm", "the colocated engine (its get_metrics: spec counters)", attribute=True
    ),
    HostPrivate(
        "VLLMGeneration", "vllm_client", "the server's client (its base_url: /metrics)", attribute=True
    ),
    HostPrivate("GRPOTrainer", "vllm_generation", "TRL's vLLM generation object", attribute=True),
)


def _trainer_classes(owner: str):
    import trl

    if owner == "trainer":
        return [trl.GRPOTrainer, trl.RLOOTrainer]
    return [getattr(trl, owner)]


def check(private: HostPrivate) -> None:
    """Raise AssertionError, naming the entry, when the installed host no longer has it."""
    label = f"{private.owner}.{private.name} ({private.why})"
    if private.owner == "accelerate":
        from accelerate.state import GradientState

        assert hasattr(GradientState, private.name.split(".")[-1]), f"gone: {label}"
        return
    if private.owner == "trl":
        import trl.models

        assert callable(getattr(trl.models, private.name.split(".")[-1], None)), f"gone: {label}"
        return
    if private.owner == "VLLMGeneration":
        from trl.generation.vllm_generation import VLLMGeneration

        source = inspect.getsource(VLLMGeneration)
        if private.attribute:
            assert f"self.{private.name} =" in source, f"VLLMGeneration no longer sets {label}"
        else:
            assert "self.llm = LLM(" in inspect.getsource(getattr(VLLMGeneration, private.name)), (
                f"changed: {label}"
            )
        return
    for cls in _trainer_classes(private.owner):
        if private.attribute:  # set in __init__, or a class attribute
            found = hasattr(cls, private.name) or f"self.{private.name}" in inspect.getsource(cls)
            assert found, f"{cls.__name__} no longer sets {label}"
            continue
        method = getattr(cls, private.name, None)
        assert callable(method), f"{cls.__name__} has no {label}"
        params = tuple(inspect.signature(method).parameters)
        assert params[: len(private.params)] == private.params, (
            f"{cls.__name__}.{private.name}{params}: {label}"
        )


# ---------------------------------------------------------------------------- accessors


def metrics(trainer: Any, mode: str = "train") -> dict[str, list]:
    """TRL's metrics sink for ``mode`` (values appended per step, averaged at logging)."""
    return trainer._metrics[mode]


@contextlib.contextmanager
def scratch_metrics(trainer: Any) -> Iterator[None]:
    """Send TRL's metrics to a scratch dict for the duration."""
    saved = trainer._metrics
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    try:
        yield
    finally:
        trainer._metrics = saved


def advance_micro_step(trainer: Any) -> None:
    """TRL's per-micro-batch step counter (its generation schedule reads it)."""
    trainer._step += 1


def add_step_time(trainer: Any, seconds: float) -> None:
    """TRL's ``step_time`` metric: micro-batch times summed over an optimizer step."""
    trainer._current_train_step_time += seconds
    if trainer._step % trainer.current_gradient_accumulation_steps == 0:
        metrics(trainer)["step_time"].append(trainer._current_train_step_time)
        trainer._current_train_step_time = 0.0


@contextlib.contextmanager
def sync_gradients(trainer: Any, value: bool) -> Iterator[None]:
    """accelerate's ``sync_gradients`` set to ``value`` for the duration."""
    state = trainer.accelerator.gradient_state
    old = state.sync_gradients
    state._set_sync_gradients(value)
    try:
        yield
    finally:
        state._set_sync_gradients(old)


@contextlib.contextmanager
def vllm_engine_kwargs(extra: Callable[[dict[str, Any]], dict[str, Any]]) -> Iterator[None]:
    """TRL's colocated ``LLM(...)`` gets ``extra(kwargs)`` added to its keyword arguments for the duration."""
    import trl.generation.vllm_generation as vg

    missing = object()
    original = getattr(vg, "LLM", missing)  # absent without vLLM: TRL refuses use_vllm before calling it

    def llm(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**kwargs, **extra(kwargs)})

    vg.LLM = llm
    try:
        yield
    finally:
        if original is missing:
            del vg.LLM
        else:
            vg.LLM = original


def deepspeed_config(trainer: Any) -> dict[str, Any]:
    """The DeepSpeed config accelerate built the trainer's engine from (``{}`` without DeepSpeed)."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return dict(getattr(plugin, "deepspeed_config", None) or {})


def deepspeed_engine(trainer: Any) -> Any:
    """The DeepSpeed engine accelerate's ``backward`` drives (``DeepSpeedEngineWrapper.engine``)."""
    return trainer.accelerator.deepspeed_engine_wrapped.engine


def vllm_generation(trainer: Any) -> Any:
    """TRL's ``VLLMGeneration`` of a trainer with ``use_vllm=True``."""
    return trainer.vllm_generation


def unwrap_for_generation(trainer: Any):
    """TRL's context that yields the model its generation runs (DeepSpeed-3 gathering included)."""
    from trl.models import unwrap_model_for_generation

    return unwrap_model_for_generation(
        trainer.model_wrapped,
        trainer.accelerator,
        gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
        gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
    )
