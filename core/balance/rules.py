"""When one step's rows may move between data-parallel ranks: the rule behind every host's ``tree_balance``.

:func:`~forkrl.core.balance.rebalance` regroups a step's rows over the ranks and over their
micro-batches. The host's update stays its own where every loss term weights a row independently
of the rows that share its micro-batch (per-sequence means over a fixed number of rows, or the
step's global token count) and where a row carries all the step reads of it. Two kinds of reason
stop it:

- ``fixed``: the rows cannot move. A vision-language model's rows would move without their images
  (:data:`IMAGES`); a sequence-parallel group's ranks share each step's micro-batches instead of
  holding rows of their own (:func:`shared_by`).
- ``loss``: a loss term reads a micro-batch as a whole (:data:`ENTROPY_BONUS`, :data:`ROUTER_LOSS`,
  or a host's own: a loss normalised by a micro-batch's tokens or width, its statistics, a
  quantile), or the ranks' windows differ in length.

``tree_balance`` (:class:`~forkrl.core.train.TreeOptions`): ``auto`` balances over several ranks
unless a reason holds, and then leaves the rows where the host put them; ``on`` does the same and
a configuration with a reason, or with one rank, is refused; ``off`` never balances. Each host
reads its settings into the reasons and spells its option in its own words (:class:`BalanceOption`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ENTROPY_BONUS",
    "IMAGES",
    "ROUTER_LOSS",
    "BalanceOption",
    "shared_by",
]

#: ``fixed``: a vision-language model's rows (their images stay where the host put them).
IMAGES = "which a vision-language model's rows cannot do: they would move without their images"
#: ``loss``: terms that read a micro-batch as a whole.
ENTROPY_BONUS = "the entropy bonus is a token mean over each micro-batch"
ROUTER_LOSS = "the MoE router load-balancing loss averages expert loads over each micro-batch"


def shared_by(group: str, step: str = "optimizer step") -> str:
    """``fixed``: a sequence-parallel ``group`` (e.g. "a Ulysses group (ulysses_sequence_parallel_size=2)"),
    whose ranks share each ``step``'s micro-batches instead of holding rows of their own."""
    return f"which {group} does not do: its ranks share each {step}'s micro-batches instead"


@dataclass(frozen=True)
class BalanceOption:
    """``tree_balance`` as one host spells it, and the rule over its settings.

    Attributes:
        on: the option set to ``on`` in the host's words (``"forkrl.tree_balance: on"``).
        auto: likewise ``auto``.
        off: likewise ``off``.
        update: what a loss reason would change (``"veRL's update"``).
    """

    on: str
    auto: str
    off: str
    update: str = "the update"

    def refusal(
        self,
        choice: str,
        ranks: int | None = None,
        *,
        fixed: str | None = None,
        loss: str | None = None,
        counted: str = "",
    ) -> str | None:
        """Why the host refuses ``choice`` (only ``on`` is ever refused), or None.

        Args:
            choice: ``tree_balance``'s value.
            ranks: the data-parallel ranks (None: not known where the host checks).
            fixed: why the rows cannot move (None: they can).
            loss: why moving them would change the update (None: it would not).
            counted: how the host counted ``ranks``, named when there is one.
        """
        if choice != "on":
            return None
        if fixed is not None:
            return (
                f"{self.on} moves rows between data-parallel ranks, {fixed}; use {self.auto} (which leaves the "
                f"rows in place) or {self.off}"
            )
        if ranks is not None and ranks < 2:
            return (
                f"{self.on} balances rows over data-parallel ranks, and this run has one"
                f"{f' ({counted})' if counted else ''}, so it would have no effect: drop it (the default auto "
                "balances when there are several)"
            )
        if loss is not None:
            return (
                f"{self.on} would change {self.update}: {loss}; use {self.off} (or {self.auto}, which leaves the "
                "rows in place for such a loss)"
            )
        return None

    @staticmethod
    def balances(choice: str, ranks: int, *, fixed: str | None = None, loss: str | None = None) -> bool:
        """Whether the step's rows move (``on`` with a reason is refused earlier: :meth:`refusal`).
        The same answer on every rank where its arguments are: the balancer is a collective."""
        return choice != "off" and ranks > 1 and fixed is None and loss is None
