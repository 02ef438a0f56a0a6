"""forkrl's actor config for veRL: ``FSDPActorConfig`` plus a ``forkrl`` block of tree options.

Selected from the override YAML with ``_target_: forkrl.plugins.verl.config.ForkrlFSDPActorConfig``
on ``actor_rollout_ref.actor`` (and ``.ref``). The ``forkrl`` block takes the same names as every
host (:class:`forkrl.core.train.TreeOptions`: ``tree_packing``, ``tree_mode``, ``tree_block_size``,
``tree_replay_threshold``, ``long_context_replay``, ``long_context_prompt_grad``, ``tree_balance``).
With tree training on, the engine backend becomes forkrl's (``fsdp2_tree``); ``strategy`` itself
stays ``fsdp2``, so every other part of veRL sees its own FSDP2 actor.

Every refusal the configuration alone decides fires when veRL builds and validates the config on
the driver, before Ray starts (``verl.utils.config.validate_config`` builds the actor's config and
calls its ``validate``): the ``forkrl`` blocks, the FSDP settings the tree does not take, veRL
features it does not reproduce, LoRA, and a speculative config on a rollout other than vLLM.
veRL's driver builds only the actor's config, so the actor also carries, as interpolations
(``include/forkrl_base.yaml``), what those checks read outside its node: the reference's
``forkrl`` block and FSDP settings (``forkrl_ref``) and the run's distillation switch
(``forkrl_run``); ``include/forkrl_speculative_base.yaml`` adds the rollout's name
(``forkrl_speculative_rollout``). Each error names the node the user wrote (``forkrl_node``: the
YAML names the reference's). What only a batch decides (images, routed experts, per-sample
temperatures) is refused by the engine at that batch, on every rank together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from verl.workers.config import FSDPActorConfig

from forkrl.core import TreeOptions
from forkrl.core.balance.rules import shared_by
from forkrl.core.options import changed_fields
from forkrl.plugins.vllm import check_installs

from . import announce, register
from .balance import OPTION, unsafe_reason
from .engine import BACKEND

__all__ = ["ACTOR", "REF", "ForkrlFSDPActorConfig", "tree_options"]

# Every veRL process that builds this config (the YAML's _target_) looks up the engine after it:
# registering here finds forkrl's engine without an environment variable or an entry point.
register()

#: The config nodes this class is built from (named in errors).
ACTOR = "actor_rollout_ref.actor"
REF = "actor_rollout_ref.ref"

#: The way out every refusal offers (veRL's own engine for that node).
_OFF = "set {node}.forkrl.tree_packing=false to train that node with veRL's own engine"


def tree_options(block: Any, where: str = "the forkrl block") -> TreeOptions:
    """A ``forkrl`` block (dict or OmegaConf node) as validated :class:`TreeOptions`.

    Raises:
        ValueError: on an unknown key (naming the known ones) or an invalid value, naming ``where``.
    """
    values = dict(block or {})
    known = {f.name for f in dataclasses.fields(TreeOptions)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"unknown forkrl option(s) {unknown} in {where}; forkrl's options are {sorted(known)}"
        )
    try:
        return TreeOptions(**values)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _is_fp16(precision: Any) -> bool:
    from verl.utils.torch_dtypes import PrecisionType

    return precision is not None and PrecisionType.to_dtype(precision) == torch.float16


def engine_refusals(node: str, *, param_offload: bool, pad_to_length: bool, param_dtype: Any) -> list[str]:
    """What an FSDP engine config of ``node`` sets that forkrl's tree engine does not run with, each
    as ``"<key>=<value>: <why>; <fix>"`` (empty: nothing). ``param_dtype`` is
    ``fsdp_config.mixed_precision.param_dtype`` (None: veRL's default, bf16)."""
    out = []
    if param_offload:
        out.append(
            f"{node}.fsdp_config.param_offload=True: the tree step gathers the parameters into its own replica once "
            "per step and is built for parameters that stay on the device; set it to false"
        )
    if pad_to_length:
        out.append(
            f"{node}.pad_to_length=True: it pads veRL's packed micro-batches to fixed shapes for veRL's kernels, and "
            "the tree forms its own units, so it would do nothing; set it to false"
        )
    if _is_fp16(param_dtype):
        out.append(
            f"{node}.fsdp_config.mixed_precision.param_dtype={param_dtype!r}: veRL's fp16 loss scaling scales each "
            "micro-batch's backward, which the tree's one backward per step does not reproduce; use bf16"
        )
    return out


def _refuse(node: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(
            "forkrl's tree engine cannot run this configuration: "
            + "; ".join(problems)
            + f" (or {_OFF.format(node=node)})"
        )


@dataclass
class ForkrlFSDPActorConfig(FSDPActorConfig):
    """veRL's ``FSDPActorConfig`` with forkrl's tree options in ``forkrl``.

    Overrides ``__post_init__`` (the node's own checks; names the engine backend) and ``validate``
    (veRL calls it on the driver with the model config: the checks that read it); every other
    field and check is veRL's.
    """

    forkrl: dict = field(default_factory=dict)
    #: Which node of veRL's config this is, as errors name it (the YAML sets the reference's).
    forkrl_node: str = ACTOR
    #: On the actor only: the reference's ``forkrl`` block and FSDP settings (``forkrl``,
    #: ``param_offload``, ``pad_to_length``, ``param_dtype``, ``use_kl_in_reward``), checked here
    #: because veRL's driver builds only the actor's config.
    forkrl_ref: dict | None = None
    #: On the actor only: run-wide settings the checks read (``distillation``: veRL's
    #: ``distillation.enabled``).
    forkrl_run: dict | None = None
    #: Set by the speculative YAMLs: the rollout backend (``actor_rollout_ref.rollout.name``);
    #: forkrl's drafter runs in vLLM only.
    forkrl_speculative_rollout: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        node = self.forkrl_node
        options = tree_options(self.forkrl, f"{node}.forkrl")  # this node's own block first
        ref = dict(self.forkrl_ref or {})
        if "forkrl" in ref:
            tree_options(ref["forkrl"], f"{REF}.forkrl")
        self._check_speculative()
        if options.tree_enabled:
            self._check_tree(node, options)
        object.__setattr__(self, "forkrl", dataclasses.asdict(options))
        if options.tree_enabled:
            unsafe = self._balance_unsafe()
            note = (
                "; veRL's use_prefix_grouper is set: it only keeps each uid group on one rank in veRL's legacy "
                "trainer's balancing, the tree shares the prefixes"
                if self.use_prefix_grouper
                else ""
            )
            announce(
                f"forkrl: veRL plugin active: {self.strategy} actor trains and scores on prefix trees "
                f"({_summary(options)}){note}"
            )
            object.__setattr__(self.engine, "strategy", BACKEND)
            object.__setattr__(self.engine, "forkrl", options)
            object.__setattr__(self.engine, "forkrl_balance_unsafe", unsafe)

    def validate(self, n_gpus: int, train_batch_size: int, model_config: dict | None = None) -> None:
        """veRL's checks, then forkrl's that read the model config (veRL runs this on the driver)."""
        super().validate(n_gpus, train_batch_size, model_config)
        model = dict(model_config or {})
        actor_tree = TreeOptions(**self.forkrl).tree_enabled
        ref = dict(self.forkrl_ref or {})
        lora = int(model.get("lora_rank") or 0) > 0
        if actor_tree and lora:
            raise ValueError(
                f"forkrl's tree engine does not train LoRA policies (actor_rollout_ref.model.lora_rank={model['lora_rank']}): "
                "under FSDP2 the tree step runs on a plain replica of the model's class, which does not carry veRL's "
                f"PEFT wrapping (nor its adapter switch for reference log-probs); set lora_rank=0, or {_OFF.format(node=ACTOR)}"
            )
        ranks = n_gpus // self.ulysses_sequence_parallel_size
        counted = f"trainer.n_gpus_per_node x trainer.nnodes = {n_gpus}"
        refusal = OPTION.refusal(self.forkrl["tree_balance"], ranks, counted=counted) if actor_tree else None
        if refusal is not None:
            raise ValueError(f"{ACTOR}.{refusal}")
        if actor_tree and model.get("use_fused_kernels"):
            raise ValueError(
                "forkrl's tree engine cannot run with actor_rollout_ref.model.use_fused_kernels=True: veRL's fused "
                "kernels replace the model's LM head, and the tree forms log-probs with its own head at the scored rows; "
                f"set it to false, or {_OFF.format(node=ACTOR)}"
            )
        if "forkrl" not in ref or lora:  # no reference block, or the reference is the actor without adapters
            return
        ref_tree = tree_options(ref["forkrl"], f"{REF}.forkrl").tree_enabled
        ref_used = bool(self.use_kl_loss or ref.get("use_kl_in_reward"))
        if ref_tree and ref_used:
            if model.get("use_fused_kernels"):
                raise ValueError(
                    "forkrl's tree engine cannot score the reference with actor_rollout_ref.model.use_fused_kernels=True "
                    f"(veRL's fused LM head); set it to false, or {_OFF.format(node=REF)}"
                )
            _refuse(
                REF,
                engine_refusals(
                    REF,
                    param_offload=bool(ref.get("param_offload")),
                    pad_to_length=bool(ref.get("pad_to_length")),
                    param_dtype=ref.get("param_dtype"),
                ),
            )

    # ------------------------------------------------------------------ checks
    def _check_speculative(self) -> None:
        rollout = self.forkrl_speculative_rollout
        if rollout is not None and rollout != "vllm":
            raise ValueError(
                f"forkrl's self-speculative rollouts run in vLLM's engine; actor_rollout_ref.rollout.name={rollout!r} "
                "would not read them (engine_kwargs.vllm) and sample without speculation: set "
                "actor_rollout_ref.rollout.name=vllm, or use --config-name forkrl_tree for tree training without "
                "speculative rollouts"
            )
        if rollout is not None:
            check_installs("use --config-name forkrl_tree (tree training without speculative rollouts)")

    def _check_tree(self, node: str, options: TreeOptions) -> None:
        if self.strategy != "fsdp2":
            raise ValueError(
                f"forkrl's tree engine runs on veRL's FSDP2 engine; {node}.strategy={self.strategy!r}: set strategy: fsdp2, "
                f"or {_OFF.format(node=node)}"
            )
        sp = self.ulysses_sequence_parallel_size
        ulysses = (
            shared_by(f"a Ulysses group (ulysses_sequence_parallel_size={sp})", "mini-batch")
            if sp > 1
            else None
        )
        refusal = OPTION.refusal(options.tree_balance, fixed=ulysses, loss=self._balance_unsafe())
        if refusal is not None:
            raise ValueError(refusal)
        problems = engine_refusals(
            node,
            param_offload=self.fsdp_config.param_offload,
            pad_to_length=self.pad_to_length or self.fsdp_config.pad_to_length,
            param_dtype=(self.fsdp_config.mixed_precision or {}).get("param_dtype"),
        )
        if self.use_fused_kernels:
            problems.append(
                "actor_rollout_ref.model.use_fused_kernels=True: veRL's fused kernels replace the model's LM head, and "
                "the tree forms log-probs with its own head at the scored rows; set it to false"
            )
        if self.calculate_sum_pi_squared:
            problems.append(
                f"{node}.calculate_sum_pi_squared=True: the tree returns log-probs and entropies, not the sum of "
                "squared probabilities; set it to false"
            )
        if (self.forkrl_run or {}).get("distillation"):
            problems.append(
                "distillation.enabled=True: veRL's distillation loss reads the teacher's log-probs against the "
                "student's logits, which the tree does not form; set it to false"
            )
        _refuse(node, problems)

    def _balance_unsafe(self) -> str | None:
        return unsafe_reason(
            getattr(self.policy_loss, "loss_mode", "vanilla"), self.loss_agg_mode, self.loss_scale_factor
        )


def _summary(options: TreeOptions) -> str:
    """The options a user set, as ``name=value`` (what differs from the defaults)."""
    changed = [f"{n}={getattr(options, n)}" for n in changed_fields(options, TreeOptions)]
    return ", ".join(changed) or "defaults"
