"""One depth-first pass over a forest's execution units (keep and replay modes).

The pass is a small state machine over three steps (:class:`Step`):

- ``ENTER`` a unit: forward it over its ancestors' cache (with grad in keep mode; without in
  replay mode and when scoring), apply the LM head at its scored rows, and hand its own
  keys/values to its descendants as leaf tensors;
- ``LEAVES``: a batch of sibling leaves in one right-padded forward over their parent's cache
  (causal attention never lets a real token see the padding after it); in a gradient pass its
  head and one backward follow at once, so the ancestors' key/value gradient of all the siblings
  arrives in one call per layer;
- ``LEAVE`` a unit: drop its cache; in replay mode forward it again with grad (forwards are
  deterministic: the executor refuses dropout), then backpropagate it once with its head's gradient plus the gradient its
  descendants accumulated into its keys/values, which passes on to its ancestors.

Only one root-to-leaf path is alive at a time.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from .. import attention
from ..tree import PrefixForest, Unit, plan
from .cache import LayerPast, NodeKV, recorded
from .head import ScoredHead
from .router import RouterPass, token_nodes
from .staging import HeadRowsBuilder, padded_batch
from .vision import VisionBatch

__all__ = ["DepthFirstPass", "Step"]


def phase(name: str) -> contextlib.AbstractContextManager:
    """A profiler label for a phase of the pass (``gpu_check``'s tables), only while a profiler
    runs: a label is itself a dispatched op."""
    return record_function(name) if torch.autograd.profiler._is_profiler_enabled else contextlib.nullcontext()


class Step(enum.Enum):
    """The steps of a depth-first pass."""

    ENTER = "enter"
    LEAVE = "leave"
    LEAVES = "leaves"


@dataclass
class _Frame:
    """What a unit keeps between entering and leaving."""

    hidden_rows: torch.Tensor | None = None  # [R, hidden] in the unit's graph (keep mode)
    hidden_grad: torch.Tensor | None = None  # [R, hidden] gradient from the LM head
    kv: NodeKV | None = None  # the unit's own keys/values (in graph when forwarded with grad)
    leaves: NodeKV | None = None  # detached copies handed to descendants
    router: torch.Tensor | None = None  # the MoE router loss's surrogate term, in the unit's graph


class DepthFirstPass:
    """A score (``grad=False``) or gradient pass of ``executor`` over ``forest``.

    Args:
        executor: the :class:`~forkrl.core.executor.TreeExecutor` (model, mode, options).
        forest: the batch.
        grad: a gradient pass (coefficients applied by ``head``) or a no-grad scoring pass.
        head: writes log-probs/entropies and applies the coefficients.
        pieces: hand the ancestors' caches to the attention as separate pieces (split attention).
        router: records the router logits of each forward (MoE load-balancing loss), or None.
        vision: the batch's images (a vision-language model, bound to ``forest``), or None.
    """

    def __init__(
        self,
        executor,
        forest: PrefixForest,
        grad: bool,
        head: ScoredHead,
        pieces: bool,
        router: RouterPass | None = None,
        vision: VisionBatch | None = None,
    ) -> None:
        self.ex = executor
        self.adapter = executor.adapter
        self.grad, self.head, self.pieces, self.router = grad, head, pieces, router
        self.vision = vision
        block = executor.block_size if (executor.mode == "replay" or not grad) else None
        self.units, self.roots = plan(forest, block)
        self.replay = grad and executor.mode == "replay"
        self.device = executor.device
        self.batches = self._schedule()
        self._stage()
        self.past: list[LayerPast] = [[] for _ in range(self.adapter.num_layers)]
        self.past_len = 0
        self.frames: dict[int, _Frame] = {}
        self.arenas: dict[int, list] = {}  # node -> per-layer cache buffers shared by its blocks

    def run(self) -> None:
        stack: list[tuple[Step, object]] = [(Step.ENTER, r) for r in reversed(self.roots)]
        while stack:
            step, arg = stack.pop()
            if step is Step.ENTER:
                stack.extend(self.enter(arg))
            elif step is Step.LEAVE:
                self.leave(arg)
            else:
                self.leaves(*arg)

    # ------------------------------------------------------------------ steps
    def enter(self, u: int) -> list[tuple[Step, object]]:
        """Forward unit ``u`` on the way down; returns the steps to push (popped in reverse)."""
        unit = self.units[u]
        frame = _Frame()
        frozen = self.grad and unit.context_only and self.ex.prompt_grad == "none"
        with phase("forkrl.prompt_forward"):
            kv = self._forward_down(u, frame, frozen)
        if unit.children:
            frame.leaves = self._cache_leaves(unit, kv, self.grad and not frozen)
            if frozen:
                frame.kv = frame.leaves  # constants either way; do not keep a second copy
            for i in range(self.adapter.num_layers):
                self.past[i].append(frame.leaves.layers[i])
            self.past_len += len(unit.tokens)
        self.frames[u] = frame
        steps: list[tuple[Step, object]] = [(Step.LEAVE, u)]
        batches = self.batches.get(u, [])
        batched = {c for b in batches for c in b}
        children = [c for c in unit.children if c not in batched]
        steps += [(Step.LEAVES, (u, b)) for b in reversed(range(len(batches)))]  # popped: shortest first
        return steps + [(Step.ENTER, c) for c in reversed(children)]

    def leave(self, u: int) -> None:
        """Drop unit ``u``'s cache; in a gradient pass, (re-forward and) backpropagate it."""
        unit = self.units[u]
        frame = self.frames.pop(u)
        if unit.children:
            for i in range(self.adapter.num_layers):
                self.past[i].pop()
            self.past_len -= len(unit.tokens)
            if unit.offset == 0:
                self.arenas.pop(unit.node, None)  # the blocks still running hold their slices
        if not self.grad:
            return
        if frame.kv is None:  # replay: forward again with grad (forwards draw no random numbers)
            hidden, frame.kv, frame.router = self._forward(u)
            frame.hidden_rows, frame.hidden_grad = self.head.unit(self.unit_rows[u], hidden[0], grad=True)
            del hidden
        with phase("forkrl.prompt_backward"):
            self._backpropagate(frame)

    def leaves(self, parent: int, b: int) -> None:
        """Sibling leaves (batch ``b`` of ``parent``'s children) as one right-padded batch over
        their shared cache: scored, or in a gradient pass forwarded with grad and backpropagated
        at once (one LM head and one backward for the batch)."""
        batch = [self.units[i] for i in self.batches[parent][b]]
        ids, rows = self.batch_ids[(parent, b)], self.batch_rows[(parent, b)]
        width = ids.shape[1]
        start = batch[0].start
        cache = self.adapter.make_cache(self.past, self.past_len, batch=len(batch), pieces=self.pieces)
        with torch.set_grad_enabled(self.grad):
            routers = self._routers()
            with phase("forkrl.leaves_forward"):
                hidden = self._hidden(ids, start, [u.node for u in batch], cache, routers)
            term = None
            if routers is not None:
                nodes = token_nodes([u.node for u in batch], [len(u.tokens) for u in batch], width)
                term = self.router.record(routers, nodes)
        outputs, grads = [], []
        if term is not None:
            outputs.append(term)
            grads.append(torch.ones_like(term))
        with torch.set_grad_enabled(self.grad):
            flat = hidden.reshape(-1, hidden.shape[-1])
        with phase("forkrl.head"):
            out_rows, grad = self.head.unit(rows, flat, grad=self.grad)
        if out_rows is not None and out_rows.requires_grad:
            outputs.append(out_rows)
            grads.append(grad)
        del hidden, flat, cache
        if outputs:
            with phase("forkrl.leaves_backward"):
                torch.autograd.backward(outputs, grads)

    # ------------------------------------------------------------------ pieces of the steps
    def _forward_down(self, u: int, frame: _Frame, frozen: bool) -> NodeKV:
        """Forward a unit on the way down; returns its keys/values (``frame.kv`` is set only where
        the way up needs no second forward)."""
        # Keep mode forwards with grad once, on the way down. Replay forwards without grad here and
        # again with grad on the way up, except for leaves, whose way up follows at once.
        unit = self.units[u]
        direct = self.grad and not frozen and (not self.replay or not unit.children)
        with torch.set_grad_enabled(direct):
            hidden, kv, frame.router = self._forward(u)
        rows = self.unit_rows[u]
        if direct:
            frame.hidden_rows, frame.hidden_grad = self.head.unit(rows, hidden[0], grad=True)
        elif frozen or not self.grad:
            # Frozen (truncated gradient): the head still learns from the rows, nothing flows further.
            self.head.unit(rows, hidden[0], grad=frozen)
        if direct or frozen:
            frame.kv = kv
        return kv

    def _forward(self, u: int) -> tuple[torch.Tensor, NodeKV, torch.Tensor | None]:
        """``[1, n, hidden]`` final hidden states of unit ``u``, its keys/values, its router term (or None)."""
        unit = self.units[u]
        if self.past_len != unit.start:
            raise RuntimeError(
                f"internal: cache holds {self.past_len} positions but the unit starts at {unit.start}"
            )
        ids = self.unit_tokens[u].unsqueeze(0)
        cache = self.adapter.make_cache(self.past, self.past_len, pieces=self.pieces)
        routers = self._routers()
        hidden = self._hidden(ids, unit.start, [unit.node], cache, routers)
        term = (
            self.router.record(routers, torch.full((len(unit.tokens),), unit.node))
            if routers is not None
            else None
        )
        return hidden, recorded(cache), term

    def _hidden(self, ids: torch.Tensor, start: int, nodes: list[int], cache, routers) -> torch.Tensor:
        """``[B, n, hidden]`` of ``[B, n]`` ids whose column 0 is at ``start``; ``nodes``: per row, its
        forest node (a batch's image rows and multimodal positions, :mod:`.vision`)."""
        vision = self.vision
        if vision is None:
            pos = torch.arange(start, start + ids.shape[1], device=self.device).expand(ids.shape[0], -1)
            return self.adapter.hidden(ids, pos, cache=cache, routers=routers)
        embeds, pos, extra = vision.inputs(self.adapter.base.get_input_embeddings(), ids, start, nodes)
        mask = vision.attention(self.adapter.base, embeds, pos, cache, ids, start, nodes)
        return self.adapter.hidden(
            None, pos, cache=cache, attention_mask=mask, routers=routers, inputs_embeds=embeds, **extra
        )

    def _routers(self) -> list | None:
        """A list for the next forward's router logits, or None when this forward records none."""
        return [] if self.router is not None and self.router.wants() else None

    def _backpropagate(self, frame: _Frame) -> None:
        outputs: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if frame.hidden_rows is not None and frame.hidden_rows.requires_grad:
            outputs.append(frame.hidden_rows)
            grads.append(frame.hidden_grad)
        if frame.router is not None and frame.router.requires_grad:
            outputs.append(frame.router)
            grads.append(torch.ones_like(frame.router))
        if frame.leaves is not None:
            for out, leaf in zip(frame.kv.tensors(), frame.leaves.tensors(), strict=True):
                # Frozen projections (e.g. LoRA on q/v only) give keys without a graph.
                if leaf.grad is not None and out.requires_grad:
                    outputs.append(out)
                    grads.append(leaf.grad)
        if outputs:
            torch.autograd.backward(outputs, grads)

    def _cache_leaves(self, unit: Unit, kv: NodeKV, requires_grad: bool) -> NodeKV:
        """Detached keys/values (leaf tensors) that the unit hands to its descendants.

        Blocks of one long node (replay) write theirs into one buffer per layer, and their
        gradients accumulate into one zeroed buffer: a long prompt's cache and its gradient are
        then two allocations per layer rather than two per block and layer (each allocation of a
        block's keys costs a page more than its bytes: 1.6% of the cache at 2048-token blocks).
        """
        if not unit.is_block:
            return kv.detached(requires_grad)
        if unit.offset == 0:
            self.arenas[unit.node] = [None] * len(kv.layers)
        buffers = self.arenas[unit.node]
        out: list[tuple[torch.Tensor, ...]] = []
        for i, layer in enumerate(kv.layers):
            if self.adapter.layer_kinds[i] == "none":
                out.append(())
                continue
            if self.adapter.layer_kinds[i] in ("state", "mixed"):  # conv/recurrent state: the last block's
                out.append(NodeKV([layer]).detached(requires_grad).layers[0])
                continue
            if buffers[i] is None:
                buffers[i] = _arena(layer, unit.node_len, requires_grad)
            elif requires_grad and buffers[i][1] is None:  # after frozen blocks (prompt_grad="none")
                buffers[i] = (buffers[i][0], tuple(t.new_zeros(t.shape) for t in buffers[i][0]))
            out.append(_arena_leaves(buffers[i], layer, unit.offset, requires_grad))
        return NodeKV(out)

    def _schedule(self) -> dict[int, list[list[int]]]:
        """Per unit, the batches its batchable leaf children run in (decided on the host up front)."""
        batches = {}
        for u, unit in enumerate(self.units):
            kids = [c for c in unit.children if self._batchable(self.units[c])]
            if kids:
                batches[u] = self._leaf_batches(kids, self.units[kids[0]].start)
        return batches

    def _stage(self) -> None:
        """Every index the pass uses, on the device with one copy (:mod:`.staging`)."""
        builder = HeadRowsBuilder()
        handles = [
            builder.add(u.rows.numpy(), u.entry_row.numpy(), u.entry_ids.numpy(), u.entry_target.numpy())
            for u in self.units
        ]
        extra, keys = [u.tokens.numpy() for u in self.units], []
        batch_handles = {}
        for parent, batches in self.batches.items():
            for b, members in enumerate(batches):
                ids, head = padded_batch([self.units[i] for i in members])
                batch_handles[(parent, b)] = builder.add(*head)
                extra.append(ids)
                keys.append((parent, b))
        heads, moved = builder.build(self.device, extra)
        self.unit_rows = [heads[h] for h in handles]
        self.unit_tokens = moved[: len(self.units)]
        self.batch_ids = dict(zip(keys, moved[len(self.units) :], strict=True))
        self.batch_rows = {key: heads[h] for key, h in batch_handles.items()}

    def _splits(self) -> bool:
        """Whether attention runs split over the shared pieces (no per-sequence copy of the context)."""
        if not self.pieces:
            return False
        dtype = attention.compute_dtype(self.device, self.adapter.head.weight.dtype)
        return attention.kernels_for(self.device, dtype) is not None

    def _batchable(self, unit: Unit) -> bool:
        """A leaf that runs in a sibling batch: one forward (with grad, or scoring), nothing kept.
        Not a frozen context-only leaf, which takes the frozen path of :meth:`enter`."""
        return not unit.children and not (self.grad and unit.context_only and self.ex.prompt_grad == "none")

    def _leaf_batches(self, leaf_ids: list[int], start: int) -> list[list[int]]:
        """Group sibling leaves by length into batches of at most ``budget`` padded tokens.

        A batch's tokens are ``batch x longest``, plus ``batch x context`` where the attention
        copies the ancestors' cache per sequence (no split attention): ``leaf_batch_tokens`` bounds
        a gradient pass (the activations autograd keeps for one batch: memory flat in group size),
        ``score_batch_tokens`` a scoring pass. A replay gradient pass runs leaves one at a time:
        its memory is one root-to-leaf path's whatever the group size (what replay is chosen for);
        """
        budget = self.ex.leaf_batch_tokens if self.grad else self.ex.score_batch_tokens
        if self.replay:  # one leaf at a time: replay's memory is one root-to-leaf path's
            budget = 1
        context = 0 if self._splits() else start  # the leaves' context: the positions before them
        leaf_ids = sorted(leaf_ids, key=lambda i: len(self.units[i].tokens))
        batches: list[list[int]] = []
        cur: list[int] = []
        for i in leaf_ids:
            width = context + len(self.units[i].tokens)
            if cur and (len(cur) + 1) * width > budget:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        return batches


def _arena(layer: tuple[torch.Tensor, ...], node_len: int, requires_grad: bool):
    # [node_len, kv_heads, head_dim]: a block is a contiguous slice, seen as [1, kv, n, d] (the layout
    # the projections produce), and its gradient slice has the same strides.
    shape = [(node_len, t.shape[1], t.shape[3]) for t in layer]
    data = tuple(t.new_empty(s) for t, s in zip(layer, shape, strict=True))
    grads = tuple(t.new_zeros(s) for t, s in zip(layer, shape, strict=True)) if requires_grad else None
    return data, grads


def _arena_leaves(buffer, layer: tuple[torch.Tensor, ...], offset: int, requires_grad: bool) -> tuple:
    data, grads = buffer
    a = offset
    leaves = []
    for j, t in enumerate(layer):
        b = a + t.shape[2]
        view = data[j][a:b].permute(1, 0, 2).unsqueeze(0)
        view.copy_(t.detach())
        leaf = view.detach().requires_grad_(requires_grad)
        if requires_grad:
            leaf.grad = grads[j][a:b].permute(1, 0, 2).unsqueeze(0)
        leaves.append(leaf)
    return tuple(leaves)
