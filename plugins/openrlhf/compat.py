"""Every OpenRLHF name and private the OpenRLHF plugin relies on, in one place.

OpenRLHF has no plugin interface: its CLI builds the Ray actors from module-level names, and its
actors build their trainer from a module-level name. The plugin swaps those names for forkrl's
subclasses (:data:`SWAPS`, scoped with :func:`swapped`), and reads a few privates through the
accessors below. Each :class:`Private` says what is relied on, and
``tests/openrlhf/test_openrlhf_contract.py`` checks every entry against the installed OpenRLHF,
so an upgrade that changes one fails in one test with the entry's name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from forkrl.core.compat import Private, parameter_names
from forkrl.core.compat.probes import reads, takes

__all__ = [
    "CHECKED",
    "PRIVATES",
    "SWAPS",
    "Private",
    "engine_of",
    "ring_attention_off",
    "ring_group",
    "swapped",
    "with_methods",
]

CHECKED = "openrlhf 0.11.2 (deepspeed 0.19.6, transformers 5.15.0, ray 2.55.0)"


def _swap(module: str, name: str, why: str) -> Private:
    """A module-level name of OpenRLHF (or Ray) the plugin swaps: it must exist where it is looked up."""

    def probe() -> None:
        import importlib

        assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"

    return Private("OpenRLHF", f"{module}.{name}", why, probe, CHECKED)


#: The module-level names the plugin replaces (scoped with :func:`swapped`), and where.
SWAPS: tuple[Private, ...] = (
    _swap(
        "openrlhf.trainer.ray.ppo_actor",
        "PolicyModelActor",
        "driver: train_ppo_ray imports it at module level to build the actor group",
    ),
    _swap(
        "openrlhf.trainer.ray.launcher",
        "ReferenceModelActor",
        "driver: train_ppo_ray imports it at module level to build the reference group",
    ),
    _swap(
        "openrlhf.utils.config",
        "hierarchize",
        "driver: train_ppo_ray's __main__ imports it after parsing; forkrl's options are attached to its result",
    ),
    _swap(
        "openrlhf.utils",
        "get_strategy",
        "driver, parse only: train() calls it first after ray.init; the launcher's dry run stops there",
    ),
    _swap(
        "ray",
        "is_initialized",
        "driver, parse only: train() starts Ray unless it is initialised; the dry run starts nothing",
    ),
    _swap(
        "openrlhf.trainer.ray.ppo_actor",
        "ActorPPOTrainer",
        "worker: PolicyModelActor.init_model_from_pretrained builds its trainer by this global name",
    ),
    _swap(
        "openrlhf.trainer.ray.ppo_actor",
        "iter_grad_accum_global_norm",
        "worker: ActorPPOTrainer.ppo_train groups micro-batches into optimizer-step windows with it",
    ),
    _swap(
        "openrlhf.trainer.ray",
        "create_vllm_engines",
        "driver (the CPU run, forkrl.plugins.openrlhf.cpu_run): train_ppo_ray imports it at module level to build "
        "the vLLM engines; the CPU rollout's create_engines takes its arguments",
    ),
    _swap(
        "openrlhf.trainer.ray.vllm_engine",
        "RolloutRayActor",
        "driver (--forkrl.speculative_rollout): create_vllm_engines builds each engine with "
        "RolloutRayActor.options(...).remote(**actor_kwargs), whose kwargs become vLLM's AsyncEngineArgs",
    ),
    _swap(
        "openrlhf.trainer.ppo_trainer",
        "PPOTrainer",
        "driver (--forkrl.speculative_rollout): train() imports it inside the function and builds the trainer "
        "actor with PPOTrainer.remote(...); its _compute_rollout_stats gains spec/* metrics",
    ),
    _swap(
        "openrlhf.trainer.ppo_trainer_async",
        "TrainingActor",
        "driver (--forkrl.speculative_rollout with --train.async_enable): PPOTrainerAsync builds its training "
        "actor with TrainingActor.remote(...), a BasePPOTrainer as PPOTrainer is",
    ),
)


@contextlib.contextmanager
def swapped(module: ModuleType | str, **names: Any) -> Iterator[None]:
    """Replace module-level ``names`` of ``module`` for the duration of the block (restored after,
    also on error). Only names listed in :data:`SWAPS` may be swapped."""
    if isinstance(module, str):
        import importlib

        module = importlib.import_module(module)
    allowed = {swap.name for swap in SWAPS}
    unknown = {name for name in names if f"{module.__name__}.{name}" not in allowed}
    if unknown:
        raise AssertionError(f"{sorted(unknown)} of {module.__name__} are not listed in compat.SWAPS")
    saved = {name: getattr(module, name) for name in names}
    try:
        for name, value in names.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def with_methods(actor_class: Any, module: str, **methods: Any) -> Any:
    """An OpenRLHF Ray actor class (``@ray.remote``, which Ray forbids subclassing) with ``methods``
    added or overridden: a Ray actor class of a subclass of the class it wraps, named as it."""
    import ray

    base = actor_class.__ray_actor_class__
    return ray.remote(type(base.__name__, (base,), {**methods, "__module__": module}))


def engine_of(actor: torch.nn.Module) -> Any:
    """The DeepSpeed engine inside an OpenRLHF ``Actor`` (``strategy.prepare`` sets ``actor.model``)."""
    return actor.model


def ring_group():
    """OpenRLHF's ring-attention group (``--ds.ring_attn_size > 1``; set by the strategy), or None."""
    from openrlhf.models.ring_attn_utils import get_ring_attn_group

    return get_ring_attn_group()


@contextlib.contextmanager
def ring_attention_off() -> Iterator[None]:
    """``ring_flash_attn``'s attention switched off while the tree's passes run.

    Under ring attention OpenRLHF's strategy replaces transformers' flash-attention entry with
    ``ring_flash_attn``'s, which attends a rank's slice of a packed micro-batch to the keys gathered
    over the ring group. The tree runs whole sequences on every rank, so an attention call that
    reaches the model's own implementation (the split attention does not apply) must stay local:
    with the switch off the entry is plain flash attention.
    """
    if ring_group() is None:
        yield
        return
    from ring_flash_attn.adapters import hf_adapter

    previous = hf_adapter.RING_ATTN_SWITCH
    hf_adapter.use_ring_attn(False)
    try:
        yield
    finally:
        hf_adapter.use_ring_attn(previous)


# ---------------------------------------------------------------------- the contract
def _swaps() -> None:
    import importlib

    src = reads(
        importlib.import_module("openrlhf.cli.train_ppo_ray"),
        "from openrlhf.utils import get_strategy",
        "from openrlhf.trainer.ray.ppo_actor import PolicyModelActor",
        "ReferenceModelActor,",
        "from openrlhf.utils.config import hierarchize",
        "args = hierarchize(args)",
    )
    train = src[src.index("def train(args):") :]
    assert (
        train.index("ray.is_initialized()")
        < train.index("get_strategy(args)")
        < train.index("RayActorGroup(")
    )
    from openrlhf.trainer.ray import vllm_engine

    reads(
        vllm_engine.create_vllm_engines,
        *("RolloutRayActor.options(", ".remote(**actor_kwargs)", '"model": pretrain'),
        '"tensor_parallel_size": tensor_parallel_size',
    )
    reads(vllm_engine.RolloutRayActor.__ray_actor_class__, "vllm.AsyncEngineArgs(*args, **self.kwargs)")
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    reads(PolicyModelActor.__ray_actor_class__.init_model_from_pretrained, "self.trainer = ActorPPOTrainer(")


def _window() -> None:
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    reads(
        ActorPPOTrainer.ppo_train,
        *("iter_grad_accum_global_norm(", "self.strategy.accumulated_gradient"),
        "self.training_step(experience, kl_ctl, step, loss_batch_info)",
        "((exp, None) for exp in pbar)",
    )


def _training_step() -> None:
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    takes(
        ActorPPOTrainer.training_step, "self", "experience", "kl_ctl", "step", "loss_batch_info", exact=True
    )
    # The loss half reads the actor once and hands the loss to strategy.backward; the tail steps.
    reads(
        ActorPPOTrainer.training_step,
        "self.actor(",
        "self.strategy.backward(loss, self.actor, self.actor_optim)",
        "self.strategy.optimizer_step(self.actor_optim, self.actor, self.actor_scheduler",
        "self.strategy.moving_average(",
        "self.strategy.get_grad_norm(self.actor)",
        "self.replay_buffer.dynamic_optimizer_step[step]",
        "output.entropy[:, -experience.action_mask.shape[1] :]",
        'metrics["actor_lr"]',
        # The MoE router loss: the model's aux_loss times the coefficient (and the dynamic scale),
        # weighted the same way by the plugin (TreeActorPPOTrainer._router_weight).
        "aux_loss = output.aux_loss * self.args.actor.aux_loss_coef",
        "aux_loss = aux_loss * self.replay_buffer.dynamic_sample_loss_scale[step]",
    )
    reads(ActorPPOTrainer.__init__, "self.aux_loss = self.args.actor.aux_loss_coef > 1e-8")


def _actor_layout() -> None:
    from openrlhf.models import Actor

    # Positions count real tokens from 0; log-probs over the last num_actions columns, masked.
    reads(
        Actor.forward,
        "position_ids = attention_mask.long().cumsum(-1) - 1",
        "log_probs[:, -action_mask.shape[1] :] * action_mask.float()",
        'output["logits"].div_(self.temperature)',
    )


def _scoring() -> None:
    from openrlhf.trainer.ray.launcher import ReferenceModelActor
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    for actor in (PolicyModelActor, ReferenceModelActor):
        takes(actor.__ray_actor_class__.forward, "self", "sequences", "action_mask", "attention_mask")


def _strategy() -> None:
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    reads(DeepspeedStrategy.backward, "model.backward(loss)")
    reads(DeepspeedStrategy.optimizer_step, "model.step()")


def _ring() -> None:
    from openrlhf.models import ring_attn_utils
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    assert callable(ring_attn_utils.get_ring_attn_group)
    reads(DeepspeedStrategy.setup_ring_attn, 'ds_device_mesh["sp"].get_group()')
    try:
        from ring_flash_attn.adapters import hf_adapter
    except ImportError:  # optional in OpenRLHF: only ring-attention runs install it
        return
    assert callable(hf_adapter.use_ring_attn) and isinstance(hf_adapter.RING_ATTN_SWITCH, bool)
    reads(hf_adapter.substitute_hf_flash_attn, "if RING_ATTN_SWITCH")


def _cpu_run() -> None:
    import importlib

    from openrlhf.trainer.ray import vllm_engine
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    # The CPU rollout's create_engines takes create_vllm_engines's arguments, as train() passes them.
    create = vllm_engine.create_vllm_engines
    takes(create, "num_engines", "tensor_parallel_size", "pretrain", "seed")
    for name in ("agent_func_path", "remote_rm_url", "max_images_per_prompt"):
        assert name in parameter_names(create), name
    # The workers' patches (forkrl.plugins.openrlhf.cpu_patches, cpu_rollout) replace these.
    mesh = importlib.import_module("openrlhf.utils.deepspeed.deepspeed")
    assert callable(mesh.init_device_mesh)
    reads(mesh.DeepspeedStrategy.setup_distributed, "self.ds_device_mesh = init_device_mesh(")
    assert "max_norm" in parameter_names(mesh.DeepspeedStrategy.get_ds_train_config)
    buffer = importlib.import_module("openrlhf.trainer.ppo_utils.replay_buffer").NaiveReplayBuffer
    reads(buffer.__init__, 'self.target_device = torch.device(f"cuda:{torch.cuda.current_device()}")')
    reads(ActorPPOTrainer.__init__, "self._init_vllm_sync_group(backend)")
    takes(ActorPPOTrainer.broadcast_to_vllm, "self", exact=True)
    # The vLLM rollout (cpu_vllm): eager engines through create_vllm_engines's 7th argument, and
    # RolloutRayActor's engine as self.llm (an AsyncLLM: collective_rpc, reset_prefix_cache).
    assert parameter_names(create)[4:7] == ["full_determinism", "enable_prefix_caching", "enforce_eager"]
    reads(vllm_engine.RolloutRayActor.__ray_actor_class__, "self.llm = vllm.AsyncLLMEngine")


def _spec_metrics() -> None:
    from openrlhf.trainer import ppo_trainer, ppo_trainer_async

    # speculative_trainer overrides _compute_rollout_stats, merged into each step's status
    for trainer in (ppo_trainer.PPOTrainer, ppo_trainer_async.TrainingActor):
        assert issubclass(trainer.__ray_actor_class__, ppo_trainer.BasePPOTrainer)
    reads(
        ppo_trainer.BasePPOTrainer.train_step,
        *("rollout_stats = self._compute_rollout_stats(experiences)", "status.update(rollout_stats)"),
    )
    reads(ppo_trainer.BasePPOTrainer.__init__, "self.vllm_engines = vllm_engines")


def _vlm() -> None:
    from openrlhf.models import Actor
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from openrlhf.utils import vlm_utils

    assert "mm_train_inputs" in Experience.__dataclass_fields__
    reads(Actor.__init__, "self.is_vlm = is_vlm_model(pretrain_or_model)")
    # The placeholders by id over the whole row (video 2), as the tree finds them without token types.
    reads(
        Actor.forward,
        "token_type_ids = (sequences == cfg.image_token_id)",
        "token_type_ids[sequences == cfg.video_token_id] = 2",
        "position_ids = None",
    )
    # One dict (or None) per sample, concatenated in row order: row_images splits them back per row.
    reads(
        vlm_utils.merge_mm_train_inputs,
        *("for mm_dict in (item if isinstance(item, list) else [item])", "torch.cat(v, dim=0)"),
    )
    reads(ActorPPOTrainer.training_step, "merge_mm_train_inputs(experience.mm_train_inputs")


PRIVATES: tuple[Private, ...] = (
    *SWAPS,
    Private(
        "OpenRLHF",
        "train_ppo_ray.train's order and imports",
        "the names SWAPS replaces are imported and looked up where and when the plugin expects",
        _swaps,
        CHECKED,
    ),
    Private(
        "OpenRLHF",
        "window",
        "ppo_train groups micro-batches with iter_grad_accum_global_norm",
        _window,
        CHECKED,
    ),
    Private(
        "OpenRLHF",
        "training_step",
        "its loss half (actor, PolicyLoss, KL, entropy, strategy.backward) runs on tree leaves; its tail "
        "(optimizer step, EMA, grad norm, lr) is mirrored by the plugin",
        _training_step,
        CHECKED,
    ),
    Private(
        "OpenRLHF",
        "actor_layout",
        "Actor.forward's positions, log-prob columns and temperature",
        _actor_layout,
        CHECKED,
    ),
    Private(
        "OpenRLHF",
        "scoring",
        "old and reference log-probs come through the actors' forward",
        _scoring,
        CHECKED,
    ),
    Private(
        "OpenRLHF",
        "strategy",
        "DeepspeedStrategy.backward/optimizer_step call the engine's",
        _strategy,
        CHECKED,
    ),
    Private(
        "OpenRLHF",
        "ring",
        "the ring-attention group (get_ring_attn_group) and ring_flash_attn's switch (use_ring_attn), which "
        "the tree turns off inside its passes",
        _ring,
        CHECKED,
    ),
    Private(
        "OpenRLHF",
        "cpu_run",
        "the CPU run's stand-ins: create_vllm_engines's arguments, and the device mesh, DeepSpeed config, replay "
        "buffer device and vLLM weight sync its worker patches replace",
        _cpu_run,
        CHECKED,
    ),
    Private(
        "OpenRLHF",
        "spec_metrics",
        "BasePPOTrainer.train_step merges _compute_rollout_stats's dict into the step's status, and keeps the "
        "engines as self.vllm_engines (spec/* come from there)",
        _spec_metrics,
        CHECKED,
    ),
    Private(
        "OpenRLHF",
        "vlm",
        "a vision-language Actor (is_vlm) takes each sample's mm_train_inputs dict, concatenated in row order, "
        "its placeholders found by image_token_id and its positions computed by the model",
        _vlm,
        CHECKED,
    ),
)
