"""Depth-first training and scoring of a causal LM over a prefix forest.

Each node is forwarded once with the keys/values of its ancestors as leaf tensors that require
grad. Its descendants run next and add their gradients into those leaves. Then the node is
backpropagated once with its own loss plus the accumulated key/value gradients, which pass on to
its ancestors. Only one root-to-leaf path is alive at a time, and every shared token is computed
once; the parameter gradient equals plain per-sequence autograd (AReaL-DTA, arXiv 2602.00482,
adds the same K/V-gradient accumulation to a DFS over a prefix tree).

Modes:
    keep: a node's graph stays alive while its subtree runs (one forward per token).
    replay: nodes run without grad on the way down and are re-forwarded with grad on the way up;
        long nodes are cut into ``block_size`` blocks, so activation memory is one block's.
    packed: the whole forest as one sequence with a tree attention mask; attention-only models.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from . import attention as tree_attention
from .models import ModelAdapter, NodeKV, UnsupportedModelError
from .tree import PrefixForest

logger = logging.getLogger(__name__)

__all__ = ["CoefficientFn", "ExecNode", "ScoreResult", "TreeExecutor", "UnsupportedModelError", "plan"]

# (entry_ids [E], logprobs [E], entropies [E] or None) -> (d loss/d logprob [E], d loss/d entropy [E] or None)
CoefficientFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]
]

_MODES = ("keep", "replay", "packed")


@dataclass(eq=False)
class ExecNode:
    """A unit of execution: a forest node, or one block of it in replay mode.

    Attributes:
        tokens: ``[n]`` token ids.
        start: absolute position of the first token.
        parent: index of the parent unit, -1 for a root.
        children: indices of the child units.
        rows: ``[R]`` sorted offsets whose hidden states feed the LM head.
        entry_row: ``[E]`` index into ``rows`` per entry (non-decreasing).
        entry_ids: ``[E]`` global entry ids.
        entry_target: ``[E]`` target tokens.
        context_only: no token of the unit is scored by any sequence (a prompt block).
        node: index of the forest node the unit is (a block of).
        offset: position of the unit's first token inside that node.
        node_len: length of that node.
    """

    tokens: torch.Tensor
    start: int
    parent: int
    children: list[int] = field(default_factory=list)
    rows: torch.Tensor = None  # type: ignore[assignment]
    entry_row: torch.Tensor = None  # type: ignore[assignment]
    entry_ids: torch.Tensor = None  # type: ignore[assignment]
    entry_target: torch.Tensor = None  # type: ignore[assignment]
    context_only: bool = False
    node: int = -1
    offset: int = 0
    node_len: int = 0


def plan(forest: PrefixForest, block_size: int | None = None) -> tuple[list[ExecNode], list[int]]:
    """Cut forest nodes into execution units of at most ``block_size`` tokens.

    Returns:
        The units in depth-first pre-order, and the indices of the roots.
    """
    units: list[ExecNode] = []
    last_unit: dict[int, int] = {}
    roots: list[int] = []
    for node in forest.nodes:
        n = len(node.tokens)
        bs = n if block_size is None else block_size
        # Absolute row offset of every entry inside the node.
        entry_rows_abs = node.rows[node.entry_row] if node.num_entries else torch.zeros(0, dtype=torch.long)
        entry_ids = torch.arange(node.entry_offset, node.entry_offset + node.num_entries)
        parent = last_unit[node.parent] if node.parent >= 0 else -1
        for b0 in range(0, n, bs):
            b1 = min(b0 + bs, n)
            lo = int(torch.searchsorted(entry_rows_abs, b0))
            hi = int(torch.searchsorted(entry_rows_abs, b1))
            rows_abs = entry_rows_abs[lo:hi]
            rows, inverse = torch.unique(rows_abs, sorted=True, return_inverse=True)
            unit = ExecNode(
                tokens=node.tokens[b0:b1],
                start=node.start + b0,
                parent=parent,
                rows=rows - b0,
                entry_row=inverse.reshape(-1),
                entry_ids=entry_ids[lo:hi],
                entry_target=node.entry_target[lo:hi],
                context_only=node.start + b1 <= node.first_scored,
                node=node.index,
                offset=b0,
                node_len=n,
            )
            idx = len(units)
            units.append(unit)
            if parent >= 0:
                units[parent].children.append(idx)
            else:
                roots.append(idx)
            parent = idx
        last_unit[node.index] = parent
    return units, roots


@dataclass
class ScoreResult:
    """Per-sequence results of a pass over a forest.

    Attributes:
        logprobs: one ``[len_i - score_from_i]`` tensor per sequence.
        entropies: same shapes, or None when not asked for.
        entry_logprobs: ``[num_entries]`` the same values per distinct scored token.
        entry_entropies: ``[num_entries]`` or None.
    """

    logprobs: list[torch.Tensor]
    entropies: list[torch.Tensor] | None
    entry_logprobs: torch.Tensor
    entry_entropies: torch.Tensor | None


@dataclass
class _Frame:
    """What a unit keeps between going down (enter) and coming back up (exit)."""

    hidden_rows: torch.Tensor | None = None  # [R, hidden] in the unit's graph (keep mode)
    hidden_grad: torch.Tensor | None = None  # [R, hidden] gradient from the LM head
    kv: NodeKV | None = None  # the unit's own keys/values (in graph in keep mode)
    leaves: NodeKV | None = None  # detached copies handed to descendants
    rng: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # RNG state before the first forward


class TreeExecutor:
    """Runs a causal LM over a :class:`PrefixForest`, scoring and backpropagating each token once.

    Args:
        model: a transformers ``*ForCausalLM`` (optionally PEFT-wrapped) whose decoder accepts a
            cache built from tensors (Llama, Qwen2/3, Mistral, Gemma families; MHA, GQA, MQA).
        mode: ``"keep"``, ``"replay"`` or ``"packed"`` (module docstring).
        block_size: replay mode: the longest span forwarded at once (None: whole nodes). Also
            bounds the no-grad forward of ``score`` in every non-packed mode.
        temperature: logits are divided by it before the softmax, as the host samples.
        head_chunk_elems: at most this many logits (rows x vocab) exist at once.
        score_batch_tokens: ``score`` runs sibling leaves as one batch while batch x (context +
            longest leaf) stays under this.
        prompt_grad: ``"exact"`` (default): gradients pass through every token. ``"none"``: the
            truncated gradient of LongStraw (arXiv 2607.14952): context that no sequence scores
            (prompts) runs without autograd and its hidden states and keys/values are constants;
            only the LM head still gets the gradient of the first scored token it predicts.
        split_attention: on the CPU with sdpa, run each node's attention as an unmasked part over
            the ancestors' cache and a causal part over itself (:mod:`forkrl.core.attention`), so no
            ``[node, context]`` mask is built or kept for backward. False: the model's own attention.

    Raises:
        UnsupportedModelError: for models it cannot run in this mode, naming the alternative.
        ValueError: on a bad mode, block size or temperature.
    """

    def __init__(
        self,
        model: nn.Module,
        mode: str = "keep",
        block_size: int | None = None,
        temperature: float = 1.0,
        head_chunk_elems: int = 1 << 25,
        score_batch_tokens: int = 1 << 15,
        prompt_grad: str = "exact",
        split_attention: bool = True,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode={mode!r} is not one of {_MODES}")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ValueError(f"block_size={block_size!r} must be a positive integer or None")
        if prompt_grad not in ("exact", "none"):
            raise ValueError(f"prompt_grad={prompt_grad!r} must be 'exact' or 'none'")
        if prompt_grad == "none" and mode == "packed":
            raise ValueError(
                "prompt_grad='none' needs the prompt to run separately from the responses: use mode='keep' or "
                "mode='replay'"
            )
        if not (isinstance(temperature, (int, float)) and temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature={temperature!r} must be a positive finite number")
        self.adapter = ModelAdapter(model)
        self.model = model
        self.mode = mode
        self.block_size = block_size
        self.temperature = float(temperature)
        self.head_chunk_elems = head_chunk_elems
        self.score_batch_tokens = score_batch_tokens
        self.prompt_grad = prompt_grad
        self.split_attention = split_attention
        if mode == "packed":
            self._check_packed()
        self._warned_checkpointing = False
        self._pieces = False  # ancestors' caches as separate pieces (with split attention)

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def score(self, forest: PrefixForest, entropy: bool = False) -> ScoreResult:
        """Log-probs (and entropies) of every scored token, without grad.

        Args:
            forest: the batch.
            entropy: also return the entropy of each predicting distribution.

        Returns:
            :class:`ScoreResult`, one ``[len_i - score_from_i]`` tensor per sequence.
        """
        lp, ent = self._run(forest, grad=False, entropy=entropy, coef=None)
        return self._result(forest, lp, ent)

    def backward(
        self,
        forest: PrefixForest,
        grad_logprobs: Sequence[torch.Tensor] | None = None,
        grad_entropies: Sequence[torch.Tensor] | None = None,
        coefficient_fn: CoefficientFn | None = None,
        entropy: bool = False,
    ) -> ScoreResult:
        """Accumulate into ``param.grad`` the gradient of a linear functional of the log-probs.

        The functional is ``sum_i sum_t grad_logprobs[i][t] * logprob_i[t]`` (plus the same with
        entropies), computed exactly as plain per-sequence autograd would; coefficients of a token
        owned by several sequences are summed on its entry. Alternatively ``coefficient_fn``
        forms each entry's coefficients from its own log-prob during the pass (token-local
        objectives, see :mod:`forkrl.core.objective`), so no separate scoring pass is needed.

        Args:
            forest: the batch.
            grad_logprobs: one ``[len_i - score_from_i]`` tensor per sequence.
            grad_entropies: same shapes, or None.
            coefficient_fn: instead of the two above, ``(entry_ids, logprobs, entropies) ->
                (coef_logprobs, coef_entropies)``, evaluated per chunk of entries.
            entropy: pass entropies to ``coefficient_fn`` (implied by ``grad_entropies``).

        Returns:
            The detached log-probs (and entropies) the pass computed.
        """
        if (grad_logprobs is None) == (coefficient_fn is None):
            raise ValueError("give exactly one of grad_logprobs or coefficient_fn")
        if coefficient_fn is None:
            coef_lp = forest.scatter_add([torch.as_tensor(g) for g in grad_logprobs]).to(self._dtype)
            coef_ent = None
            if grad_entropies is not None:
                coef_ent = forest.scatter_add([torch.as_tensor(g) for g in grad_entropies]).to(self._dtype)
            for name, c in (("grad_logprobs", coef_lp), ("grad_entropies", coef_ent)):
                if c is not None and not torch.isfinite(c).all():
                    raise ValueError(
                        f"{name} contains NaN or inf (e.g. a NaN advantage): fix the rewards/advantages before "
                        "the backward pass; nothing was accumulated"
                    )
            coef = _StaticCoefficients(coef_lp, coef_ent)
            entropy = coef_ent is not None
        else:
            coef = coefficient_fn
        lp, ent = self._run(forest, grad=True, entropy=entropy, coef=coef)
        return self._result(forest, lp, ent)

    # ------------------------------------------------------------------ internals
    @property
    def _dtype(self) -> torch.dtype:
        dt = self.adapter.head.weight.dtype
        return dt if dt in (torch.float32, torch.float64) else torch.float32

    @property
    def device(self) -> torch.device:
        """The device the model's LM head lives on (where results are returned)."""
        return self.adapter.head.weight.device

    def _result(self, forest: PrefixForest, lp: torch.Tensor, ent: torch.Tensor | None) -> ScoreResult:
        return ScoreResult(
            logprobs=forest.gather(lp),
            entropies=forest.gather(ent) if ent is not None else None,
            entry_logprobs=lp,
            entry_entropies=ent,
        )

    def _check_packed(self) -> None:
        ad = self.adapter
        if ad.has_state:
            raise UnsupportedModelError(
                f"{type(ad.base).__name__} keeps convolution/recurrent state, which a tree attention mask cannot "
                "route: use mode='keep' or mode='replay'"
            )
        if "sliding" in ad.layer_kinds:
            raise UnsupportedModelError(
                f"{type(ad.base).__name__} has sliding-window layers; packed mode passes one tree mask to all "
                "layers: use mode='keep' or mode='replay'"
            )
        if ad.attn_implementation not in ("sdpa", "eager", None):
            raise UnsupportedModelError(
                f"packed mode needs an attention implementation that accepts a 4D tree mask (sdpa or eager); "
                f"{type(ad.base).__name__} uses {ad.attn_implementation!r}: use mode='keep'"
            )

    def _run(
        self,
        forest: PrefixForest,
        grad: bool,
        entropy: bool,
        coef: CoefficientFn | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not isinstance(forest, PrefixForest):
            raise TypeError(f"expected a PrefixForest, got {type(forest).__name__}")
        limit = getattr(self.adapter.config, "max_position_embeddings", None)
        longest = max(forest.lengths)
        if limit is not None and longest > limit:
            s = forest.lengths.index(longest)
            raise ValueError(
                f"sequence {s} has {longest} tokens but {type(self.adapter.base).__name__} supports "
                f"max_position_embeddings={limit}: truncate the rollouts or raise the model's context length"
            )
        lp = torch.zeros(forest.num_entries, dtype=self._dtype, device=self.device)
        ent = torch.zeros_like(lp) if entropy else None
        with self.adapter.checkpointing_off() as was_on:
            if was_on and not self._warned_checkpointing:
                logger.info(
                    "gradient checkpointing is on in the model; forkrl turns it off inside tree passes "
                    "(it would drop the ancestors' cache) -- use mode='replay' for the same memory saving"
                )
                self._warned_checkpointing = True
            if self.mode == "packed":
                self._run_packed(forest, grad, lp, ent, coef)
            else:
                split = self.split_attention and self.adapter.split_attention_ok(self.device)
                self._pieces = split
                with self.adapter.attention_implementation(tree_attention.NAME if split else None):
                    self._run_dfs(forest, grad, lp, ent, coef)
        return lp, ent

    # ---- depth-first (keep / replay)
    def _run_dfs(self, forest, grad, lp, ent, coef) -> None:
        block = self.block_size if (self.mode == "replay" or not grad) else None
        units, roots = plan(forest, block)
        replay = grad and self.mode == "replay"
        save_rng = replay and self.adapter.has_dropout()
        past: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in range(self.adapter.num_layers)]
        past_len = 0
        frames: dict[int, _Frame] = {}
        arenas: dict[int, list[tuple[torch.Tensor, ...] | None]] = {}  # node -> per-layer cache buffers
        # (op, unit or units): op 0 enters a unit, 1 leaves it, 2 scores a batch of sibling leaves.
        stack: list[tuple[int, object]] = [(0, r) for r in reversed(roots)]
        device = self.device
        while stack:
            op, u = stack.pop()
            if op == 2:
                self._score_leaves([units[i] for i in u], past, past_len, lp, ent)
                continue
            unit = units[u]
            if op == 0:
                frame = _Frame()
                # Keep mode forwards with grad once, on the way down. Replay forwards without grad
                # here and again with grad on the way up, except for leaves, whose way up follows
                # at once and which hand no cache down.
                frozen = grad and unit.context_only and self.prompt_grad == "none"
                direct = grad and not frozen and (not replay or not unit.children)
                if save_rng and not direct and not frozen:
                    frame.rng = _get_rng(device)
                with torch.set_grad_enabled(direct):
                    hidden, kv = self._forward_unit(unit, past, past_len)
                if direct:
                    frame.hidden_rows, frame.hidden_grad = self._head(unit, hidden, lp, ent, coef, grad=True)
                    frame.kv = kv
                elif frozen:
                    # Truncated gradient: the head still learns from the rows, nothing flows further.
                    self._head(unit, hidden, lp, ent, coef, grad=True)
                    frame.kv = kv
                elif not grad:
                    self._head(unit, hidden, lp, ent, None, grad=False)
                del hidden
                if unit.children:
                    leaves = self._cache_leaves(unit, kv, grad and not frozen, arenas)
                    frame.leaves = leaves
                    if frozen:
                        frame.kv = leaves  # constants either way; do not keep a second copy
                    for i in range(self.adapter.num_layers):
                        past[i].append(leaves.layers[i])
                    past_len += len(unit.tokens)
                if not grad:
                    frame.kv = None
                frames[u] = frame
                stack.append((1, u))
                children = unit.children
                if not grad:
                    # Scoring: sibling leaves run as one right-padded batch (causal attention never
                    # lets a real token see the padding after it), bounded by score_batch_tokens.
                    leaf_kids = [c for c in children if not units[c].children]
                    children = [c for c in children if units[c].children]
                    stack.extend((2, b) for b in self._leaf_batches(units, leaf_kids, past_len))
                stack.extend((0, c) for c in reversed(children))
                continue

            frame = frames.pop(u)
            if unit.children:
                for i in range(self.adapter.num_layers):
                    past[i].pop()
                past_len -= len(unit.tokens)
                if unit.offset == 0:
                    arenas.pop(unit.node, None)  # the blocks still running hold their slices
            if not grad:
                continue
            if frame.kv is None:  # replay: re-forward with grad, with the same random numbers
                rng_ctx = (
                    _restore_rng(frame.rng, device) if frame.rng is not None else contextlib.nullcontext()
                )
                with rng_ctx:
                    hidden, kv = self._forward_unit(unit, past, past_len)
                frame.hidden_rows, frame.hidden_grad = self._head(unit, hidden, lp, ent, coef, grad=True)
                frame.kv = kv
                del hidden
            outputs: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            if frame.hidden_rows is not None and frame.hidden_rows.requires_grad:
                outputs.append(frame.hidden_rows)
                grads.append(frame.hidden_grad)
            if frame.leaves is not None:
                for out, leaf in zip(frame.kv.tensors(), frame.leaves.tensors(), strict=True):
                    # Frozen projections (e.g. LoRA on q/v only) give keys without a graph.
                    if leaf.grad is not None and out.requires_grad:
                        outputs.append(out)
                        grads.append(leaf.grad)
            if outputs:
                torch.autograd.backward(outputs, grads)

    def _cache_leaves(self, unit: ExecNode, kv: NodeKV, requires_grad: bool, arenas: dict) -> NodeKV:
        """Detached keys/values (leaf tensors) that the unit hands to its descendants.

        Blocks of one long node (replay) write theirs into one buffer per layer, and their
        gradients accumulate into one zeroed buffer: a long prompt's cache and its gradient are
        then two allocations per layer rather than two per block and layer (each allocation of a
        block's keys costs a page more than its bytes: 1.6% of the cache at 2048-token blocks).
        """
        if unit.node_len == len(unit.tokens):
            return kv.detached(requires_grad)
        if unit.offset == 0:
            arenas[unit.node] = [None] * len(kv.layers)
        buffers = arenas[unit.node]
        out: list[tuple[torch.Tensor, ...]] = []
        a, b = unit.offset, unit.offset + len(unit.tokens)
        for i, layer in enumerate(kv.layers):
            if self.adapter.layer_kinds[i] == "state":  # conv/recurrent state: small, the last block's
                out.append(NodeKV([layer]).detached(requires_grad).layers[0])
                continue
            if buffers[i] is None:
                # [node_len, kv_heads, head_dim]: a block is a contiguous slice, seen as [1, kv, n, d]
                # (the layout the projections produce), and its gradient slice has the same strides.
                shape = lambda t: (unit.node_len, t.shape[1], t.shape[3])  # noqa: E731
                data = tuple(t.new_empty(shape(t)) for t in layer)
                grads = tuple(t.new_zeros(shape(t)) for t in layer) if requires_grad else None
                buffers[i] = (data, grads)
            data, grads = buffers[i]
            leaves = []
            for j, t in enumerate(layer):
                view = data[j][a:b].permute(1, 0, 2).unsqueeze(0)
                view.copy_(t.detach())
                leaf = view.detach().requires_grad_(requires_grad)
                if requires_grad:
                    leaf.grad = grads[j][a:b].permute(1, 0, 2).unsqueeze(0)
                leaves.append(leaf)
            out.append(tuple(leaves))
        return NodeKV(out)

    def _leaf_batches(self, units: list[ExecNode], leaf_ids: list[int], past_len: int) -> list[list[int]]:
        """Group sibling leaves (by length) so that batch x (context + longest) <= score_batch_tokens."""
        leaf_ids = sorted(leaf_ids, key=lambda i: len(units[i].tokens))
        batches: list[list[int]] = []
        cur: list[int] = []
        for i in leaf_ids:
            width = past_len + len(units[i].tokens)
            if cur and (len(cur) + 1) * width > self.score_batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        return batches[::-1]  # popped from a stack: keep length order

    def _score_leaves(self, batch: list[ExecNode], past, past_len: int, lp, ent) -> None:
        device = self.device
        width = max(len(u.tokens) for u in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for b, u in enumerate(batch):
            ids[b, : len(u.tokens)] = u.tokens
        start = batch[0].start
        pos = torch.arange(start, start + width, device=device).expand(len(batch), -1)
        cache = self.adapter.make_cache(past, past_len, batch=len(batch), pieces=self._pieces)
        hidden = self.adapter.hidden(ids.to(device), pos, cache=cache)
        for b, u in enumerate(batch):
            self._head(u, hidden[b], lp, ent, None, grad=False)

    def _forward_unit(self, unit: ExecNode, past, past_len: int) -> tuple[torch.Tensor, NodeKV]:
        device = self.device
        ids = unit.tokens.to(device).unsqueeze(0)
        pos = torch.arange(unit.start, unit.start + len(unit.tokens), device=device).unsqueeze(0)
        if past_len != unit.start:
            raise RuntimeError(
                f"internal: cache holds {past_len} positions but the unit starts at {unit.start}"
            )
        cache = self.adapter.make_cache(past, past_len, pieces=self._pieces)
        hidden = self.adapter.hidden(ids, pos, cache=cache)
        return hidden[0], self.adapter.recorded(cache)

    def _head(
        self,
        unit: ExecNode,
        hidden: torch.Tensor,
        lp: torch.Tensor,
        ent: torch.Tensor | None,
        coef: CoefficientFn | None,
        grad: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """LM head at the unit's scored rows, in chunks; in grad mode, backprop to the rows.

        Args:
            hidden: ``[n, hidden]`` the unit's final hidden states.

        Returns:
            In grad mode, the ``[R, hidden]`` rows (in the unit's graph) and their gradient;
            otherwise (None, None).
        """
        if len(unit.rows) == 0:
            return None, None
        rows = hidden[unit.rows.to(hidden.device)]
        return self._head_rows(rows, unit.entry_row, unit.entry_ids, unit.entry_target, lp, ent, coef, grad)

    def _head_rows(self, rows, entry_row, entry_ids, entry_target, lp, ent, coef, grad):
        device = rows.device
        entry_row = entry_row.to(device)
        entry_ids = entry_ids.to(device)
        entry_target = entry_target.to(device)
        vocab = self.adapter.head.weight.shape[0]
        chunk = max(1, self.head_chunk_elems // vocab)
        src = rows.detach().requires_grad_(True) if grad else rows
        want_ent = ent is not None
        r_total = rows.shape[0]
        for r0 in range(0, r_total, chunk):
            r1 = min(r0 + chunk, r_total)
            e0 = int(torch.searchsorted(entry_row, r0))
            e1 = int(torch.searchsorted(entry_row, r1))
            if e0 == e1:
                continue
            with torch.set_grad_enabled(grad):
                logp = torch.log_softmax(self.adapter.logits(src[r0:r1], self.temperature), dim=-1)
                local = entry_row[e0:e1] - r0
                e_lp = logp[local, entry_target[e0:e1]]
                e_ent = None
                if want_ent:
                    row_ent = -(logp.exp() * logp).sum(-1)
                    e_ent = row_ent[local]
            ids = entry_ids[e0:e1]
            lp[ids] = e_lp.detach().to(lp.dtype)
            if want_ent:
                ent[ids] = e_ent.detach().to(ent.dtype)
            if grad:
                c_lp, c_ent = coef(ids, e_lp.detach(), e_ent.detach() if e_ent is not None else None)
                loss = (c_lp.to(e_lp.dtype) * e_lp).sum()
                if c_ent is not None:
                    if e_ent is None:
                        raise ValueError("an entropy coefficient was given but entropies were not computed")
                    loss = loss + (c_ent.to(e_ent.dtype) * e_ent).sum()
                if loss.requires_grad:
                    loss.backward()
        if not grad:
            return None, None
        g = src.grad if src.grad is not None else torch.zeros_like(src)
        return rows, g

    # ---- packed (tree attention mask)
    def _run_packed(self, forest, grad, lp, ent, coef) -> None:
        device = self.device
        nodes = forest.nodes
        offsets = [0]
        for n in nodes:
            offsets.append(offsets[-1] + len(n.tokens))
        total = offsets[-1]
        ids = torch.cat([n.tokens for n in nodes]).to(device).unsqueeze(0)
        pos = torch.cat([torch.arange(n.start, n.end) for n in nodes]).to(device).unsqueeze(0)
        mask = torch.zeros(total, total, dtype=torch.bool, device=device)
        for n in nodes:
            a0, a1 = offsets[n.index], offsets[n.index + 1]
            mask[a0:a1, a0:a1] = torch.ones(a1 - a0, a1 - a0, dtype=torch.bool, device=device).tril()
            p = n.parent
            while p >= 0:
                mask[a0:a1, offsets[p] : offsets[p + 1]] = True
                p = nodes[p].parent
        dtype = self.adapter.head.weight.dtype
        if self.adapter.attn_implementation == "eager":
            attn = torch.zeros(total, total, dtype=dtype, device=device)
            attn.masked_fill_(~mask, torch.finfo(dtype).min)
        else:
            attn = mask
        attn = attn[None, None]
        rows = torch.cat([n.rows + offsets[n.index] for n in nodes])
        entry_row_parts, base = [], 0
        for n in nodes:
            entry_row_parts.append(n.entry_row + base)
            base += len(n.rows)
        entry_row = torch.cat(entry_row_parts)
        entry_ids = torch.arange(forest.num_entries)
        entry_target = torch.cat([n.entry_target for n in nodes])
        with torch.set_grad_enabled(grad):
            hidden = self.adapter.hidden(ids, pos, cache=None, attention_mask=attn)[0]
            h_rows = hidden[rows.to(device)]
        out_rows, g = self._head_rows(h_rows, entry_row, entry_ids, entry_target, lp, ent, coef, grad)
        if grad and out_rows is not None and out_rows.requires_grad:
            torch.autograd.backward([out_rows], [g])


class _StaticCoefficients:
    """Coefficients known before the pass: ``[num_entries]`` tensors indexed by entry id."""

    def __init__(self, coef_lp: torch.Tensor, coef_ent: torch.Tensor | None) -> None:
        self.coef_lp = coef_lp
        self.coef_ent = coef_ent

    def __call__(self, ids, logprobs, entropies):
        c_lp = self.coef_lp.to(ids.device)[ids]
        c_ent = self.coef_ent.to(ids.device)[ids] if self.coef_ent is not None else None
        return c_lp, c_ent


def _get_rng(device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    cpu = torch.get_rng_state()
    acc = [torch.cuda.get_rng_state(device)] if device.type == "cuda" else []
    return cpu, acc


@contextlib.contextmanager
def _restore_rng(state, device: torch.device):
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1]:
            torch.cuda.set_rng_state(state[1][0], device)
        yield
