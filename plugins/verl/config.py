"""forkrl's actor config for veRL: ``FSDPActorConfig`` plus a ``forkrl`` block of tree options.

Selected from the override YAML with ``_target_: forkrl.plugins.verl.config.ForkrlFSDPActorConfig``
on ``actor_rollout_ref.actor`` (and ``.ref``). The ``forkrl`` block takes the same names as every
host (:class:`forkrl.core.train.TreeOptions`: ``tree_packing``, ``tree_mode``, ``tree_block_size``,
``tree_replay_threshold``, ``long_context_replay``, ``long_context_prompt_grad``, ``tree_balance``),
validated when veRL builds the config; ``tree_balance: on`` with a loss whose update depends on
the rows' grouping is refused here (:func:`forkrl.plugins.verl.balance.unsafe_reason`). With tree training on, the engine backend becomes forkrl's (``fsdp2_tree``);
``strategy`` itself stays ``fsdp2``, so every other part of veRL sees its own FSDP2 actor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from verl.workers.config import FSDPActorConfig

from forkrl.core import TreeOptions

from .balance import unsafe_reason
from .engine import BACKEND

__all__ = ["ForkrlFSDPActorConfig", "tree_options"]


def tree_options(block: Any) -> TreeOptions:
    """A ``forkrl`` block (dict or OmegaConf node) as validated :class:`TreeOptions`.

    Raises:
        ValueError: on an unknown key (naming the known ones) or an invalid value.
    """
    values = dict(block or {})
    known = {f.name for f in dataclasses.fields(TreeOptions)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"unknown forkrl option(s) {unknown} in the forkrl block; forkrl's options are {sorted(known)}"
        )
    return TreeOptions(**values)


@dataclass
class ForkrlFSDPActorConfig(FSDPActorConfig):
    """veRL's ``FSDPActorConfig`` with forkrl's tree options in ``forkrl``."""

    forkrl: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        options = tree_options(self.forkrl)
        if options.tree_enabled and self.strategy != "fsdp2":
            raise ValueError(
                f"forkrl's tree engine runs on veRL's FSDP2 engine; actor.strategy={self.strategy!r}: set strategy: fsdp2, "
                "or set forkrl.tree_packing: false"
            )
        if options.tree_enabled and self.ulysses_sequence_parallel_size > 1:
            raise ValueError(
                "forkrl's tree engine cannot run with Ulysses sequence parallelism (ulysses_sequence_parallel_size > 1): "
                "set it to 1, or set forkrl.tree_packing: false"
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
            object.__setattr__(self.engine, "strategy", BACKEND)
            object.__setattr__(self.engine, "forkrl", options)
            object.__setattr__(self.engine, "forkrl_balance_unsafe", unsafe)
