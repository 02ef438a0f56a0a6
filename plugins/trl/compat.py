"""Every TRL, transformers-Trainer and accelerate private the TRL plugin relies on, in one place.

Each :class:`~forkrl.core.compat.Private` (the one form core and every plugin use) names a method
the plugin overrides or calls, or an attribute it reads or writes, with the reason;
``tests/trl/test_trl_contract.py`` checks every entry against the installed TRL (signatures with
``inspect.signature``, instance attributes by the trainer's source),
so an upgrade that changes one fails in one test with the entry's name. The accessors below are the
plugin's only way to underscore attributes.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from forkrl.core.compat import Private

__all__ = [
    "CHECKED",
    "PRIVATES",
    "Private",
    "add_step_time",
    "advance_micro_step",
    "entropy_bonus_enabled",
    "deepspeed_config",
    "deepspeed_engine",
    "metrics",
    "scratch_metrics",
    "sync_gradients",
    "unwrap_for_generation",
]

CHECKED = "trl 1.16.0, transformers 5.25.0, accelerate 1.16.0"


def _trainer_classes(owner: str) -> list[type]:
    import trl

    if owner == "trainer":
        return [trl.GRPOTrainer, trl.RLOOTrainer]
    return [getattr(trl, owner)]


def _label(owner: str) -> str:
    return "GRPOTrainer/RLOOTrainer" if owner == "trainer" else owner


def _method(owner: str, name: str, why: str, params: tuple[str, ...]) -> Private:
    """A method of TRL's trainer(s) (``owner``: ``"trainer"`` for both GRPOTrainer and RLOOTrainer) the
    plugin overrides or calls, with the leading parameters it passes by position."""

    def probe() -> None:
        for cls in _trainer_classes(owner):
            method = getattr(cls, name, None)
            assert callable(method), f"{cls.__name__} has no method {name}"
            found = tuple(inspect.signature(method).parameters)
            assert found[: len(params)] == params, f"{cls.__name__}.{name}{found}, expected {params} first"

    return Private("TRL", f"{_label(owner)}.{name}", why, probe, CHECKED)


def _attribute(owner: str, name: str, why: str) -> Private:
    """An instance attribute of TRL's trainer(s) (set in ``__init__``, or a class attribute) the plugin
    reads or writes."""

    def probe() -> None:
        for cls in _trainer_classes(owner):
            found = hasattr(cls, name) or f"self.{name}" in inspect.getsource(cls)
            assert found, f"{cls.__name__} no longer sets self.{name}"

    return Private("TRL", f"{_label(owner)}.{name}", why, probe, CHECKED)


def _vllm_attribute(name: str, why: str) -> Private:
    def probe() -> None:
        from trl.generation.vllm_generation import VLLMGeneration

        assert f"self.{name} =" in inspect.getsource(VLLMGeneration), (
            f"VLLMGeneration no longer sets self.{name}"
        )

    return Private("TRL", f"VLLMGeneration.{name}", why, probe, CHECKED)


def _init_vllm() -> None:
    from trl.generation.vllm_generation import VLLMGeneration

    assert "self.llm = LLM(" in inspect.getsource(VLLMGeneration._init_vllm), (
        "no `self.llm = LLM(` in _init_vllm"
    )


def _set_sync_gradients() -> None:
    from accelerate.state import GradientState

    assert hasattr(GradientState, "_set_sync_gradients"), "GradientState has no _set_sync_gradients"


def _unwrap_for_generation() -> None:
    import trl.models

    assert callable(getattr(trl.models, "unwrap_model_for_generation", None)), (
        "trl.models has no such function"
    )


PRIVATES: tuple[Private, ...] = (
    _method(
        "trainer",
        "__init__",
        "forkrl's keyword shortcut binds TRL's own parameters (it takes no **kwargs)",
        ("self", "model", "reward_funcs", "args"),
    ),
    _method(
        "trainer",
        "training_step",
        "overridden: collects the micro-batches of one optimizer step",
        ("self", "model", "inputs", "num_items_in_batch"),
    ),
    _method(
        "trainer",
        "_prepare_inputs",
        "called: TRL's generation, rewards and advantages, unchanged",
        ("self", "generation_batch"),
    ),
    _method(
        "trainer",
        "compute_loss",
        "called per micro-batch on the tree's leaves",
        ("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
    ),
    _method(
        "trainer",
        "_compute_loss",
        "compared: the fused pass trusts only TRL's own loss code",
        ("self", "model", "inputs"),
    ),
    _method(
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
    _method(
        "trainer",
        "_generate_single_turn",
        "overridden (speculative_rollout): TRL's transformers generation",
        ("self", "prompt_ids", "images", "multimodal_fields"),
    ),
    _attribute(
        "trainer", "_metrics", "the metrics sink (mode -> name -> list), and swapped out during probes"
    ),
    _attribute("trainer", "_step", "counted per micro-batch as TRL's own training_step does"),
    _attribute("trainer", "_current_train_step_time", "TRL's step_time metric"),
    _attribute(
        "trainer", "loss_is_scaled_for_ga", "whether the loss is already divided by the accumulation steps"
    ),
    _attribute("trainer", "aux_loss_enabled", "MoE router loss on: the tree adds its gradient"),
    _attribute(
        "trainer", "router_aux_loss_coef", "the MoE router loss's coefficient (its weight per micro-batch)"
    ),
    _attribute(
        "trainer",
        "_is_vlm",
        "vision-language models: the families of forkrl.core.executor.vision on the tree, others refused",
    ),
    _attribute("trainer", "_tokenizer", "pad id for the speculative sampler's left-padded prompts"),
    _attribute("trainer", "eos_token_ids", "EOS ids for the speculative sampler"),
    _attribute("GRPOTrainer", "off_policy_mask_threshold", "a value-dependent mask: no fused pass"),
    _attribute("GRPOTrainer", "top_entropy_quantile", "a value-dependent mask: no fused pass"),
    Private(
        "accelerate",
        "GradientState._set_sync_gradients",
        "set per micro-batch so TRL's once-per-step loss work (adaptive entropy) runs once",
        _set_sync_gradients,
        CHECKED,
    ),
    Private(
        "TRL",
        "trl.models.unwrap_model_for_generation",
        "the model the speculative sampler drives",
        _unwrap_for_generation,
        CHECKED,
    ),
    Private(
        "TRL",
        "VLLMGeneration." + "_init_vllm",
        "colocate mode builds `self.llm = LLM(` from the module global LLM: swapped to add the speculative config",
        _init_vllm,
        CHECKED,
    ),
    _vllm_attribute("llm", "the colocated engine (its get_metrics: spec counters)"),
    _vllm_attribute("vllm_client", "the server's client (its base_url: /metrics)"),
    _attribute("GRPOTrainer", "vllm_generation", "TRL's vLLM generation object"),
    _attribute(
        "GRPOTrainer",
        "_entropy_bonus_enabled",
        "tree_balance leaves rows in place while the entropy bonus (a token mean over each micro-batch) is on; read without a default, so a rename fails here and in the plugin, not silently as off",
    ),
)


# ---------------------------------------------------------------------------- accessors


def entropy_bonus_enabled(trainer: Any) -> bool:
    """Whether GRPO's entropy bonus is on (``_entropy_bonus_enabled``; RLOO has none). Read without a
    default: a renamed attribute raises here rather than reading as off."""
    import trl

    return False if isinstance(trainer, trl.RLOOTrainer) else bool(trainer._entropy_bonus_enabled)


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
