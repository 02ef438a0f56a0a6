"""Ulysses sequence parallelism under forkrl's veRL engine: a group's ranks share the micro-batches.

With ``ulysses_sequence_parallel_size = C > 1`` veRL hands every rank of a Ulysses group the same
rows and splits each packed sequence over the group: each rank computes ``1/C`` of every sequence's
tokens, with an all-to-all around each attention call. The tree computes whole sequences (a
prefix is shared only where one rank holds all of it), so forkrl's engine divides the group's work
the other way: rank ``s`` of the group trains (or scores) a contiguous run of the mini-batch's
micro-batches, veRL's own partition, chosen by token count
(:func:`forkrl.core.train.share_micro_batches`), and the outputs are
all-gathered so that every rank returns all micro-batches, as stock's ranks do.

Why the update is stock's, for any veRL loss: each micro-batch ``i`` keeps its rows and its
normalisers (``dp_size``, ``batch_num_tokens``, ``global_batch_size`` as stock sets them), and FSDP
averages the gradients over all ``D * C`` ranks. Stock's Ulysses ranks each hold ``C`` times their
slice's gradient (veRL's output gather scales it), so stock's update is
``1/D * sum_d sum_i grad loss_{d,i}``. Here the rank that owns micro-batch ``i`` backpropagates
``C * loss_{d,i}``, which averages over the ``D * C`` ranks to the same sum. The losses and metrics
veRL reports are each micro-batch's own, unscaled.

A mini-batch with fewer micro-batches than the group has ranks runs whole on every rank (exact too:
each rank's gradient is the dp rank's, and the average over the group's ``C`` copies is that).

With ``long_context_replay`` the group divides the work the other way round: every rank runs every
micro-batch, and each prompt is split over the group's ranks
(:class:`forkrl.core.executor.ContextParallelExecutor`: each rank keeps ``1/C`` of a prompt's cache
and computes its pieces of it while the others compute theirs; the responses are dealt to the ranks).
Every rank ends with the mini-batch's whole gradient, so FSDP's average over the ``D * C`` ranks is
stock's ``1/D * sum_d sum_i grad loss_{d,i}``; the losses and log-probs are every micro-batch's on
every rank. A prompt longer than one device holds then trains, exactly, on ``C``.

Inside the tree's passes veRL's Ulysses attention is switched off (:func:`compat.ulysses_off`): the
tree's attention calls run whole sequences (or forkrl's context-parallel attention) and must not
all-to-all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from forkrl.core.train import gather_shares

__all__ = ["gather_outputs"]


def gather_outputs(
    outputs: Sequence[dict],
    mine: Sequence[int],
    count: int,
    group,
    rebuild: Callable[[int, torch.Tensor, torch.Tensor | None], dict],
) -> list[dict]:
    """Every micro-batch's output on every rank of ``group``, in micro-batch order.

    Args:
        outputs: this rank's outputs (``loss``, ``metrics``, optional ``model_output`` of nested
            ``log_probs``/``entropy``), one per index in ``mine``.
        mine: the micro-batch indices this rank ran.
        count: the mini-batch's micro-batch count.
        group: the Ulysses process group.
        rebuild: ``(i, log_probs, entropy) -> model_output`` for micro-batch ``i`` from flat values
            (nested tensors travel as their values).
    """
    portable = [(i, _portable(out)) for i, out in zip(mine, outputs, strict=True)]
    restored = []
    for i, out in enumerate(gather_shares(portable, count, group)):
        if "model_output" in out:
            lp, ent = out.pop("model_output")
            out["model_output"] = rebuild(i, lp, ent)
        restored.append(out)
    return restored


def _portable(out: dict) -> dict:
    """``out`` with host-side values only: metrics as floats, nested model outputs as CPU values."""
    from verl.utils.metric import Metric

    def value(v):
        if isinstance(v, Metric):
            metric = Metric(aggregation=v.aggregation)
            metric.values = [float(x) for x in v.values]
            return metric
        return float(v) if isinstance(v, torch.Tensor) else v

    res = {"loss": float(out["loss"]), "metrics": {k: value(v) for k, v in out["metrics"].items()}}
    if "model_output" in out:
        mo = out["model_output"]
        ent = mo.get("entropy")
        res["model_output"] = (mo["log_probs"].values().cpu(), None if ent is None else ent.values().cpu())
    return res
