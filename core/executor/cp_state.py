"""Recurrent and conv state in context-parallel replay, carried from chunk to chunk in position order.

A hybrid model (Qwen3-Next's linear attention, Mamba-1/2 mixers beside attention as in Jamba, Bamba
and Falcon-H1, LFM2's short convolutions) has layers whose output at a position depends on a state
summarising every earlier position, not on keys and values that can stay where they were computed.
:class:`~forkrl.core.executor.context_parallel.ContextParallelReplay` runs such a model under its
serial schedule, where the prompt's blocks already run in position order (a rank's chunk, then the
next rank's), and this module carries the state between them:

- **Prefill.** Each owner forwards its blocks from the state the previous block left (a fresh cache
  per block, its state layers seeded as a tree node's are from its parent, :mod:`.cache`), and keeps
  the state entering each of its blocks for the replay. After a chunk its owner broadcasts the state
  it ends with: the next owner starts from it, and after the last chunk every rank holds the
  prompt's final state, from which its responses start (as leaves that collect its gradient).
- **Reverse replay.** The responses' state gradient is summed over the group
  (all-reduce). Each block is re-forwarded with grad from the state it entered with (leaves) and
  backpropagated with its keys'/values' gradient and the gradient of the state it leaves (the later
  block's, or the responses'); the gradient its entering state receives is the earlier block's seed.
  After a chunk (but the first) its owner broadcasts that gradient to the previous owner.

This chain is the one serial part: a chunk's blocks cannot start before the previous chunk's state
exists, whichever schedule the attention layers would allow (the parallel schedule, whose ranks
compute their pieces at once, falls back to the serial one for these models, logged). What it moves
is small beside the attention collectives: per chunk boundary one state of
``sum over state layers (conv C * k + recurrent)`` elements forward and the same backward (plus a
pickled list of shapes), where the attention moves ``O(n * L * H * d)`` per unit. Every rank issues
the same collectives (they depend on the chunk layout and ``prompt_grad`` only, never on the
responses). Each owner keeps one state per block of its chunk, as single-device replay keeps one per
block of the prompt.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .. import compat
from ..errors import UnsupportedModelError
from .cache import RecordingMixedLayer, _CarryingLayer, _state_layer, recorded
from .cp_rounds import SINGLE_DEVICE

__all__ = ["ATTENTION_KINDS", "STATE_KINDS", "StateCarry", "check_model", "schedule_for"]

logger = logging.getLogger(__name__)

ATTENTION_KINDS = ("full", "mixed")  # cache kinds whose layer runs context-parallel attention
STATE_KINDS = ("state", "mixed")  # cache kinds whose layer carries a conv/recurrent state

# Per state layer (in layer order), the tensors it carries: (conv,) or (conv, recurrent).
States = list[tuple[torch.Tensor, ...]]


def schedule_for(adapter, schedule: str) -> str:
    """The schedule a model runs: ``schedule``, but ``"serial"`` for a model with state layers (the
    parallel schedule's pieces would each start from a state not yet computed), logged (a host cannot choose the schedule, so not a warning)."""
    if adapter.has_state and schedule == "parallel":
        logger.info(
            "%s carries conv/recurrent state from chunk to chunk in position order, which the parallel "
            "schedule does not do: running context-parallel replay with schedule='serial'",
            adapter.name,
        )
        return "serial"
    return schedule


def check_model(adapter) -> None:
    """Refuse (:class:`UnsupportedModelError`, naming single-device replay) a model whose layers
    context-parallel replay cannot split: sliding windows, latent attention, softcapping, dropout."""
    kinds = sorted(set(adapter.layer_kinds) - {"full", *STATE_KINDS})
    why = None
    if kinds:
        why = f"has cache layers of kind {kinds} (context-parallel replay runs layers that attend fully and conv/recurrent state layers)"
    elif adapter.mla_modules:
        why = "uses multi-head latent attention"
    elif getattr(adapter.config, "attn_logit_softcapping", None) is not None:
        why = "softcaps its attention logits"
    elif adapter.has_dropout():
        why = "draws dropout masks in this mode (call model.eval() or set the dropout to 0)"
    if why is not None:
        raise UnsupportedModelError(
            f"{adapter.name} {why}, so it cannot run context-parallel replay: use {SINGLE_DEVICE}"
        )


class _OwnKeysLayer(_CarryingLayer):
    """A full-attention layer that returns only the unit's own keys/values (the earlier positions'
    live in the shards, reached by ``forkrl_cp`` attention) and counts ``past_len`` positions."""

    def __init__(self, past_len: int) -> None:
        super().__init__(None, past_len)


class _OwnKeysMixedLayer(RecordingMixedLayer):
    """Falcon-H1's layer of attention and a Mamba state side by side: the attention part as
    :class:`_OwnKeysLayer`, the state part recorded as in a tree node."""

    def __init__(self, past_len: int) -> None:
        super().__init__()
        self.past_len = past_len

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: D102
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.new_keys, self.new_values = key_states, value_states
        return key_states, value_states

    def get_seq_length(self) -> int:  # noqa: D102
        return self.past_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:  # noqa: D102
        return self.past_len + query_length, 0


class StateCarry:
    """One pass's state chain (module docstring), on one rank; for a model without state layers
    every hook does nothing (no cache, no collective).

    Args:
        config: the model's config (the cache template).
        kinds: per layer the cache kind (:attr:`ModelAdapter.layer_kinds`).
        group, global_ranks: the context-parallel group and its ranks' global ranks.
        keep: keep the state entering each block of this rank's for an exact replay (only where grad
            is enabled: a scoring pass has no replay).
        device: where received states are put.
    """

    def __init__(
        self, config, kinds: list[str], group, global_ranks: list[int], keep: bool, device: torch.device
    ) -> None:
        self.active = any(kind in STATE_KINDS for kind in kinds)
        self.config = config
        self.device = device
        self.kinds = kinds
        self.group = group
        self.global_ranks = global_ranks
        self.keep = keep and torch.is_grad_enabled()
        self.current: States | None = None  # the state after the last block run (prefill) or received
        self.entering: dict[int, States | None] = {}  # block start -> the state it started from
        self.final: States | None = None  # the prompt's final state as the responses' leaves
        self.seed: States | None = None  # reverse replay: the gradient of the state the next block leaves
        self.bytes_sent = 0  # state and state-gradient bytes this rank broadcast
        self._leaves: States | None = None  # the replayed block's entering state (leaves)

    # ------------------------------------------------------------------ caches
    def cache(self, state: States | None, past_len: int) -> compat.DynamicCache:
        """A fresh cache for a unit at ``past_len`` starting from ``state`` (None: position 0)."""
        template = compat.DynamicCache(config=self.config)
        layers, it = [], iter(state or ())
        for kind in self.kinds:
            if kind == "full":
                layers.append(_OwnKeysLayer(past_len))
            elif kind == "none":
                layers.append(compat.DummyLayer())
            else:
                past = [next(it)] if state is not None else []
                mixed = _OwnKeysMixedLayer(past_len) if kind == "mixed" else None
                layers.append(_state_layer(past, past_len if past else 0, 1, mixed))
        compat.replace_layers(template, layers)
        return template

    def left(self, cache: compat.DynamicCache) -> States:
        """The state a forward through ``cache`` ends with, per state layer."""
        out = []
        for kind, layer in zip(self.kinds, recorded(cache).layers, strict=True):
            if kind in STATE_KINDS:
                out.append(layer[2:] if kind == "mixed" else layer)
        return out

    @staticmethod
    def leaves(state: States | None, grad: bool) -> States | None:
        """Detached copies of ``state`` that collect their gradient when ``grad``."""
        if state is None:
            return None
        return [tuple(t.detach().requires_grad_(grad) for t in layer) for layer in state]

    @staticmethod
    def gradient(leaves: States | None) -> States | None:
        """The gradient ``leaves`` collected (zeros where none reached them)."""
        if leaves is None:
            return None
        return [
            tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in layer) for layer in leaves
        ]

    # ------------------------------------------------------------------ one unit on its owner
    def enter(self, start: int, prompt: bool, grad: bool) -> compat.DynamicCache | None:
        """The cache a unit starting at ``start`` runs with: a prompt block in the prefill from the
        state the previous block left, in the replay from leaves of the state it entered with; a
        response from the prompt's final state (None: no state layers)."""
        if not self.active:
            return None
        if not prompt:
            return self.cache(self.final, start)
        if not grad:
            if self.keep:
                self.entering[start] = self.current
            return self.cache(self.current, start)
        self._leaves = self.leaves(self.entering.pop(start), True)
        return self.cache(self._leaves, start)

    def leave(self, cache: compat.DynamicCache | None) -> None:
        """After a prefill block: the state it left is the next block's."""
        if self.active:
            self.current = [tuple(t.detach() for t in layer) for layer in self.left(cache)]

    def backward_pairs(self, cache: compat.DynamicCache | None) -> tuple[list, list]:
        """A replayed block's state outputs and their gradient (the later block's or the responses')."""
        outs, grads = [], []
        for layer, seeds in zip(self.left(cache) if self.active else [], self.seed or [], strict=True):
            for t, g in zip(layer, seeds, strict=True):
                if t.requires_grad:
                    outs.append(t)
                    grads.append(g.to(t.dtype))
        return outs, grads

    def backward_done(self) -> None:
        """After a replayed block's backward: its entering state's gradient is the earlier block's seed."""
        if self.active:
            self.seed, self._leaves = self.gradient(self._leaves), None

    def chunk_done(self, owner: int, grad: bool, world: int) -> None:
        """After chunk ``owner``: in the prefill its final state to every rank (the next owner's start;
        after the last chunk the responses'), in the replay (but chunk 0) its entering state's gradient."""
        if not self.active:
            return
        me = dist.get_rank(self.group)
        if not grad:
            self.current = self.broadcast(self.current if me == owner else None, owner)
            if owner == world - 1:
                self.final = self.leaves(self.current, self.keep)
        elif owner > 0:
            self.seed = self.broadcast(self.seed if me == owner else None, owner)

    # ------------------------------------------------------------------ the chain's collectives
    def broadcast(self, state: States | None, src: int) -> States:
        """``state`` from group rank ``src`` (its shapes first), on every rank of the group."""
        me = dist.get_rank(self.group)
        meta = [[(tuple(t.shape), t.dtype) for t in layer] for layer in state] if me == src else None
        box = [meta]
        dist.broadcast_object_list(box, src=self.global_ranks[src], group=self.group)
        out = []
        for i, layer in enumerate(box[0]):
            tensors = []
            for j, (shape, dtype) in enumerate(layer):
                if me == src:
                    t = state[i][j].detach().contiguous()
                else:
                    t = torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(t, self.global_ranks[src], group=self.group)
                if me == src:
                    self.bytes_sent += t.numel() * t.element_size()
                tensors.append(t)
            out.append(tuple(tensors))
        return out

    def sum_final_gradient(self) -> None:
        """The responses' gradient of the prompt's final state, summed over the group into ``seed``."""
        if not self.active:
            return
        seed = [tuple(t.contiguous() for t in layer) for layer in self.gradient(self.final)]
        for layer in seed:
            for t in layer:
                dist.all_reduce(t, group=self.group)
        self.seed = seed
