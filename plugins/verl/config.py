"""forkrl's actor config for veRL: ``FSDPActorConfig`` plus a ``forkrl`` block of tree options.

Selected from the override YAML with ``_target_: forkrl.plugins.verl.config.ForkrlFSDPActorConfig``
on ``actor_rollout_ref.actor`` (and ``.ref``). The ``forkrl`` block takes the same names as every
host (:class:`forkrl.core.train.TreeOptions`: ``tree_packing``, ``tree_mode``, ``tree_block_size``,
``tree_replay_threshold``, ``long_context_replay``, ``long_context_prompt_grad``, ``tree_balance``),
validated when veRL builds the config; ``tree_balance: on`` with a loss whose update depends on
the rows' grouping is refused here (:func:`forkrl.plugins.verl.balance.unsafe_reason`). With tree
training on, the engine backend becomes forkrl's (``fsdp2_tree``); ``strategy`` itself stays
``fsdp2``, so every other part of veRL sees its own FSDP2 actor.

veRL's ``validate_config`` builds only the actor's config on the driver, so the actor also carries
the reference's block (``forkrl_ref``, an interpolation in ``include/forkrl_base.yaml``) and checks
it there: a wrong reference key fails before Ray starts, not inside a worker.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from verl.workers.config import FSDPActorConfig

from forkrl.core import TreeOptions
from forkrl.core.options import changed_fields

from . import announce, register
from .balance import unsafe_reason
from .engine import BACKEND

__all__ = ["ForkrlFSDPActorConfig", "tree_options"]

# Every veRL process that builds this config (the YAML's _target_) looks up the engine after it:
# registering here finds forkrl's engine without an environment variable or an entry point.
register()


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


@dataclass
class ForkrlFSDPActorConfig(FSDPActorConfig):
    """veRL's ``FSDPActorConfig`` with forkrl's tree options in ``forkrl``."""

    forkrl: dict = field(default_factory=dict)
    #: The reference's ``forkrl`` block, on the actor only: checked where veRL builds the actor's config.
    forkrl_ref: dict | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.forkrl_ref is not None:
            tree_options(self.forkrl_ref, "actor_rollout_ref.ref.forkrl")
        options = tree_options(self.forkrl)
        if options.tree_enabled and self.strategy != "fsdp2":
            raise ValueError(
                f"forkrl's tree engine runs on veRL's FSDP2 engine; actor.strategy={self.strategy!r}: set strategy: fsdp2, "
                "or set forkrl.tree_packing: false"
            )
        if options.tree_enabled and options.tree_balance == "on" and self.ulysses_sequence_parallel_size > 1:
            raise ValueError(
                "forkrl.tree_balance: on moves rows between data-parallel ranks, which a Ulysses group "
                f"(ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size}) does not do: its ranks share "
                "each mini-batch's micro-batches instead; set forkrl.tree_balance: auto or off"
            )
        unsafe = unsafe_reason(
            getattr(self.policy_loss, "loss_mode", "vanilla"), self.loss_agg_mode, self.loss_scale_factor
        )
        if options.tree_enabled and options.tree_balance == "on" and unsafe is not None:
            raise ValueError(
                f"forkrl.tree_balance: on would change veRL's update: {unsafe}; set forkrl.tree_balance: off "
                "(or auto, which leaves such a loss's rows where veRL put them)"
            )
        object.__setattr__(self, "forkrl", dataclasses.asdict(options))
        if options.tree_enabled:
            announce(
                f"forkrl: veRL plugin active: {self.strategy} actor trains and scores on prefix trees ({_summary(options)})"
            )
            object.__setattr__(self.engine, "strategy", BACKEND)
            object.__setattr__(self.engine, "forkrl", options)
            object.__setattr__(self.engine, "forkrl_balance_unsafe", unsafe)


def _summary(options: TreeOptions) -> str:
    """The options a user set, as ``name=value`` (what differs from the defaults)."""
    changed = [f"{n}={getattr(options, n)}" for n in changed_fields(options, TreeOptions)]
    return ", ".join(changed) or "defaults"
