"""A level-batched pass: the units at one depth of many trees run as one forward.

The depth-first pass (:mod:`.dfs`) forwards each root on its own and each batch of sibling leaves
on its own, so a step of many GRPO groups runs the decoder about twice per group, each run paying
the fixed cost of a whole model's kernels. Here consecutive trees are taken in *bundles* (as many
as fit a token budget) and a bundle runs depth by depth:

- its internal units (those with children) at one depth run as one right-padded batch ``[N, W]``
  with grad, with the leaves of that depth that fit beside them, their graphs kept and their
  keys/values handed down as leaf tensors;
- its other leaves at that depth run in padded batches of at most the leaf budget, each forwarded,
  scored and backpropagated at once (their ancestors' key/value gradient accumulating);
- then the kept runs are backpropagated deepest first, each with its head's gradient and the
  key/value gradient its descendants accumulated.

Each unit attends to its own ancestors only (:mod:`forkrl.core.attention.level`), so a step runs
the decoder about once per depth of a bundle (twice for GRPO groups; with ``collapse_tokens``,
short nodes below the roots, such as a first token two completions share, are copied into their
children rather than adding a depth: :func:`forkrl.core.tree.collapsed`). Memory: a bundle's kept runs'
graphs plus one leaf batch (keep mode's, with a bundle in place of one root-to-leaf path).

Run for keep-mode passes of attention-only models whose layers all attend fully, where the level
kernels exist (:func:`eligible`); everything else (replay, recurrent state, sliding windows, latent
attention, the MoE router loss, images, the truncated prompt gradient) runs the depth-first pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import attention
from ..attention.level import LevelMasks, level_kernels_for
from ..tree import PrefixForest, Unit, collapsed
from .cache import NodeKV, build_level_cache, recorded
from .dfs import phase
from .head import ScoredHead
from .staging import HeadRows, HeadRowsBuilder, padded_batch

__all__ = ["LevelPass", "eligible"]


def eligible(executor, grad: bool, pieces: bool, router, vision) -> bool:
    """Whether ``executor``'s pass (``grad`` or scoring) runs level-batched: keep mode over whole
    nodes, split attention selected, an attention-only model without latent attention, no router
    loss or images, the exact prompt gradient, and level kernels for the device and dtype."""
    ad = executor.adapter
    dtype = attention.compute_dtype(executor.device, ad.head.weight.dtype)
    head_dim = getattr(ad.config, "head_dim", None)
    return (
        pieces
        and executor.mode == "keep"
        and (grad or executor.block_size is None)
        and executor.prompt_grad == "exact"
        and router is None
        and vision is None
        and set(ad.layer_kinds) <= {"full", "none"}
        and not ad.mla_modules
        and level_kernels_for(executor.device, dtype, head_dim) is not None
    )


@dataclass(eq=False)
class _Run:
    """One forward of a level pass: units at one depth as a right-padded batch."""

    units: list[int]
    depth: int
    ids: torch.Tensor | None = None  # [N, W] device token ids
    pos: torch.Tensor | None = None  # [N, W] device positions
    rows: HeadRows | None = None
    masks: LevelMasks | None = None  # each unit's ancestor per depth (none at depth 0)


@dataclass(eq=False)
class _Bundle:
    """Trees run together: per depth, the run holding its internal units (with the leaves that fit
    beside them; kept for the depth's backward) and the runs of its other leaves."""

    inner: list[_Run] = field(default_factory=list)
    leaves: list[list[_Run]] = field(default_factory=list)


class LevelPass:
    """A score (``grad=False``) or gradient pass of ``executor`` over ``forest``, depth by depth.

    Args:
        executor: the :class:`~forkrl.core.executor.TreeExecutor` (model, budgets).
        forest: the batch.
        grad: a gradient pass (coefficients applied by ``head``) or a no-grad scoring pass.
        head: writes log-probs/entropies and applies the coefficients.
    """

    def __init__(self, executor, forest: PrefixForest, grad: bool, head: ScoredHead) -> None:
        self.adapter = executor.adapter
        self.grad, self.head = grad, head
        self.device = executor.device
        self.units, roots = collapsed(forest, executor.collapse_tokens)
        self.depth = _depths(self.units)
        budget = executor.leaf_batch_tokens if grad else executor.score_batch_tokens
        self.bundles = self._schedule(roots, budget)
        self._stage()

    def run(self) -> None:
        for bundle in self.bundles:
            self._bundle(bundle)

    def _bundle(self, bundle: _Bundle) -> None:
        ancestors: list[NodeKV] = []  # per depth with internal units, its run's keys/values as leaf tensors
        kept: list[tuple] = []  # per such depth: (head rows, their gradient, keys/values, leaves)
        for d, leaf_runs in enumerate(bundle.leaves):
            if d < len(bundle.inner):
                with phase("forkrl.prompt_forward"), torch.set_grad_enabled(self.grad):
                    hidden, kv = self._forward(bundle.inner[d], ancestors)
                    out_rows, grad = self.head.unit(bundle.inner[d].rows, hidden, grad=self.grad)
                del hidden
                leaves = kv.detached(self.grad)
                kept.append((out_rows, grad, kv, leaves))
            for run in leaf_runs:
                self._leaves(run, ancestors)
            if d < len(bundle.inner):
                ancestors.append(leaves)
        if self.grad:
            with phase("forkrl.prompt_backward"):
                for depth in reversed(kept):
                    _backpropagate(*depth)

    def _leaves(self, run: _Run, ancestors: list[NodeKV]) -> None:
        """A batch of leaves: forwarded, scored and (gradient pass) backpropagated at once."""
        with torch.set_grad_enabled(self.grad):
            with phase("forkrl.leaves_forward"):
                hidden, _ = self._forward(run, ancestors)
            with phase("forkrl.head"):
                out_rows, grad = self.head.unit(run.rows, hidden, grad=self.grad)
        del hidden
        if out_rows is not None and out_rows.requires_grad:
            with phase("forkrl.leaves_backward"):
                torch.autograd.backward([out_rows], [grad])

    def _forward(self, run: _Run, ancestors: list[NodeKV]) -> tuple[torch.Tensor, NodeKV]:
        """``[N * W, hidden]`` final hidden states of a run (batch rows flattened) and its keys/values."""
        ad = self.adapter
        cache = build_level_cache(ad.base.config, ad.layer_kinds, ancestors[: run.depth], run.masks)
        hidden = ad.hidden(run.ids, run.pos, cache=cache)
        return hidden.reshape(-1, hidden.shape[-1]), recorded(cache)

    # ------------------------------------------------------------------ schedule (host only)
    def _schedule(self, roots: list[int], budget: int) -> list[_Bundle]:
        """Trees, by root length, in bundles whose internal units' padded tokens stay within
        ``budget`` (at least one tree each); each depth's leaves in batches of at most ``budget``
        padded tokens, by length."""
        ends = [*roots[1:], len(self.units)]  # a tree's units are contiguous in pre-order
        trees = sorted(zip(roots, ends, strict=True), key=lambda t: len(self.units[t[0]].tokens))
        bundles: list[list[int]] = []
        widths: dict[int, tuple[int, int]] = {}  # depth -> (internal units, longest) of the open bundle
        for root, end in trees:  # by prompt length: a bundle's prompts pad little
            grown = self._inner_widths(range(root, end), widths)
            if not bundles or sum(n * w for n, w in grown.values()) > budget:
                bundles.append([])
                grown = self._inner_widths(range(root, end), {})
            bundles[-1].extend(range(root, end))
            widths = grown
        return [self._bundle_runs(units, budget) for units in bundles]

    def _inner_widths(self, units: range, widths: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
        """``widths`` (per depth: internal units, longest) with ``units``' internal units added."""
        grown = dict(widths)
        for u in units:
            if self.units[u].children:
                n, w = grown.get(self.depth[u], (0, 0))
                grown[self.depth[u]] = (n + 1, max(w, len(self.units[u].tokens)))
        return grown

    def _bundle_runs(self, units: list[int], budget: int) -> _Bundle:
        depths = max(self.depth[u] for u in units) + 1
        bundle = _Bundle(leaves=[[] for _ in range(depths)])
        for d in range(depths):
            at = [u for u in units if self.depth[u] == d]
            inner = [u for u in at if self.units[u].children]
            leaves = sorted(
                (u for u in at if not self.units[u].children), key=lambda u: len(self.units[u].tokens)
            )
            if inner:
                # Leaves that fit ride along with the internal units (one decoder run per depth): their
                # graphs are then kept until the depth's backward, within the same budget.
                width = max(len(self.units[u].tokens) for u in inner)
                cap = max(budget, len(inner) * width)
                while leaves and (len(inner) + 1) * max(width, len(self.units[leaves[0]].tokens)) <= cap:
                    width = max(width, len(self.units[leaves[0]].tokens))
                    inner.append(leaves.pop(0))
                bundle.inner.append(_Run(inner, d))
            batch: list[int] = []
            for u in leaves:
                if batch and (len(batch) + 1) * len(self.units[u].tokens) > budget:
                    bundle.leaves[d].append(_Run(batch, d))
                    batch = []
                batch.append(u)
            if batch:
                bundle.leaves[d].append(_Run(batch, d))
        return bundle

    def _stage(self) -> None:
        """Every run's ids, positions, head rows and ancestor indices, on the device in one copy."""
        builder = HeadRowsBuilder()
        arrays: list[np.ndarray] = []
        staged: list[tuple[_Run, int, int, list[tuple[int, int | None, int | None]]]] = []
        for bundle in self.bundles:
            slots = [{u: i for i, u in enumerate(run.units)} for run in bundle.inner]
            for run in [*bundle.inner, *(r for runs in bundle.leaves for r in runs)]:
                units = [self.units[u] for u in run.units]
                ids, head = padded_batch(units)
                handle = builder.add(*head)
                first = len(arrays)
                starts = np.array([u.start for u in units], dtype=np.int64)
                arrays += [ids, starts[:, None] + np.arange(ids.shape[1])]
                depths = []  # per ancestor depth: (width, where its index is, where its lengths are)
                for j in range(run.depth):
                    anc = [self._ancestor(u, j) for u in run.units]
                    lengths = np.array([len(self.units[a].tokens) for a in anc], dtype=np.int64)
                    width = max(len(self.units[a].tokens) for a in bundle.inner[j].units)
                    at = None  # one ancestor at depth j: a broadcast, no index
                    if len(bundle.inner[j].units) > 1:
                        arrays.append(np.array([slots[j][a] for a in anc], dtype=np.int64))
                        at = len(arrays) - 1
                    if (lengths == width).all():  # every ancestor fills the width: no mask
                        depths.append((width, at, None))
                    else:
                        arrays.append(lengths)
                        depths.append((width, at, len(arrays) - 1))
                staged.append((run, handle, first, depths))
        heads, moved = builder.build(self.device, arrays)
        for run, handle, first, depths in staged:
            run.rows, run.ids, run.pos = heads[handle], moved[first], moved[first + 1]
            run.masks = LevelMasks(
                [None if i is None else moved[i] for _, i, _ in depths],
                [None if m is None else moved[m] for _, _, m in depths],
                [w for w, _, _ in depths],
            )

    def _ancestor(self, u: int, depth: int) -> int:
        """The unit at ``depth`` on ``u``'s path from its root."""
        while self.depth[u] > depth:
            u = self.units[u].parent
        return u


def _backpropagate(out_rows, grad, kv: NodeKV, leaves: NodeKV) -> None:
    """One backward of an internal depth: its head rows' gradient and the key/value gradient its
    descendants accumulated into its leaves."""
    outputs, grads = [], []
    if out_rows is not None and out_rows.requires_grad:
        outputs.append(out_rows)
        grads.append(grad)
    for out, leaf in zip(kv.tensors(), leaves.tensors(), strict=True):
        if leaf.grad is not None and out.requires_grad:  # frozen projections (LoRA on q/v) have none
            outputs.append(out)
            grads.append(leaf.grad)
    if outputs:
        torch.autograd.backward(outputs, grads)


def _depths(units: list[Unit]) -> list[int]:
    """Per unit, its number of ancestors (parents come before children in pre-order)."""
    depth = [0] * len(units)
    for i, unit in enumerate(units):
        if unit.parent >= 0:
            depth[i] = depth[unit.parent] + 1
    return depth
