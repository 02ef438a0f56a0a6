"""Tree steps under a sharded engine: gather once, run the tree on a plain replica, reduce once.

Two replicas: :class:`FSDP2Replica` for FSDP2 (below), and :class:`AliasReplica` for engines that
reduce gradients through hooks on the parameters (DeepSpeed ZeRO stages 0-3): its parameters alias
the model's storage, so the tree's many backwards accumulate into the replica's own gradients, and
one backward of :meth:`AliasReplica.gradient_surrogate` through the engine then hands the step's
gradient over (the engine's own scaling, hooks and reductions, once). Under ZeRO-3, whose parameters
are partitions, :meth:`AliasReplica.whole` all-gathers every partition once for the step (in
``ds_id`` order, the same on every rank) and the surrogate's backward runs inside it, so a step is
one all-gather and the engine's one reduce-scatter, against stock ZeRO-3's two all-gathers (forward,
backward) and one reduce-scatter per micro-batch.

A sharded engine (PyTorch FSDP2's ``fully_shard``) all-gathers each layer's parameters in every
forward and reduce-scatters its gradients in backward, through hooks that every rank must run in
the same order. The tree executor runs as many forwards and backwards per step as its forest has
units, and ranks hold different forests, so driving those hooks unit by unit would issue different
collective sequences on different ranks (a hang, or layers mixed up).

Here the engine's hooks are not used at all during a tree step. Every rank:

1. all-gathers every parameter once, in the module's parameter order (the same on every rank),
   into a plain replica of the model (built once on the meta device, its parameters assigned per
   step, its buffers copied from the model);
2. runs the whole tree step on the replica (any number of units: no collective runs inside);
3. reduce-scatters each parameter's gradient once into the engine's sharded gradient (average over
   ranks, as FSDP2 does), and frees the replica's parameters.

Collectives per optimizer step: one all-gather and one reduce-scatter of the model, the same on
every rank whatever its forest (stock FSDP2 with ``reshard_after_forward=True`` all-gathers twice per
micro-batch and reduce-scatters once per micro-batch, or once per step under gradient accumulation
without sync). Memory: the full parameters and full gradients for the duration of the step, as
data-parallel training holds them; the sharded optimizer state stays sharded. Models too large for
that are refused by the memory itself (an out-of-memory error), not silently changed.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from .. import compat
from .distributed import world_size

__all__ = ["AliasReplica", "FSDP2Replica", "Gather", "is_fsdp2", "is_zero3"]

#: An engine's context that makes a list of partitioned parameters whole for its duration.
Gather = Callable[[list[torch.Tensor]], AbstractContextManager]


def is_zero3(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are DeepSpeed ZeRO-3 partitions."""
    return any(compat.is_zero3_param(p) for p in model.parameters())


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` (or a module in it) is sharded with FSDP2's ``fully_shard``."""
    return any(compat.is_fsdp2_module(m) for m in model.modules())


class FSDP2Replica:
    """A plain copy of an FSDP2-sharded model, its parameters gathered per step.

    Args:
        model: the FSDP2 root module (a transformers causal LM after ``fully_shard``).

    Raises:
        UnsupportedModelError: for a model that is not an FSDP2-sharded transformers model, or
            whose parameters are not all sharded on one mesh.
    """

    def __init__(self, model: nn.Module) -> None:
        from ..errors import UnsupportedModelError

        self.model = model
        plain = compat.fsdp2_plain_class(model)
        config = getattr(model, "config", None)
        if plain is None or config is None:
            raise UnsupportedModelError(
                f"tree training under FSDP2 needs the FSDP2 root to be a transformers causal LM (fully_shard applied "
                f"to the model itself); got {type(model).__name__}: shard the whole model, or train without tree_packing"
            )
        self.params = dict(model.named_parameters())
        meshes = {compat.dtensor_mesh(p) for p in self.params.values() if compat.is_dtensor(p)}
        if len(meshes) > 1:
            raise UnsupportedModelError(
                "tree training under FSDP2 supports one device mesh (plain data-parallel sharding); this model's "
                "parameters live on several: train without tree_packing"
            )
        self.param_dtype = compat.fsdp2_param_dtype(model)
        with torch.device("meta"):
            self.replica = plain(config)
        self.replica.train(model.training)
        for name, buf in model.named_buffers():
            compat.set_tensor(self.replica, name, buf.detach().clone(), parameter=False)
        self._release()

    @contextmanager
    def gathered(self, grad: bool) -> Iterator[nn.Module]:
        """The replica holding the full parameters (one all-gather each); with ``grad``, its
        gradients are reduce-scattered into the model's sharded gradients on exit."""
        self._gather(grad)
        try:
            yield self.replica
            if grad:
                self._reduce()
        finally:
            self._release()

    # ------------------------------------------------------------------ collectives
    def _gather(self, grad: bool) -> None:
        self.replica.train(self.model.training)
        self._wide: dict[int, torch.Tensor] = {}
        self._hooks = []
        for name, p in self.params.items():
            full = compat.full_tensor(p).detach()
            if self.param_dtype is not None and full.is_floating_point():
                full = full.to(self.param_dtype)
            leaf = nn.Parameter(full, requires_grad=grad and p.requires_grad)
            # Mixed precision (bf16 compute over float32 shards): FSDP2 reduces and accumulates each
            # micro-batch's gradient in float32; the tree's many units are summed in float32 too,
            # not rounded to bf16 at every unit.
            if leaf.requires_grad and _narrower(leaf.dtype, p.dtype):
                self._hooks.append(
                    leaf.register_post_accumulate_grad_hook(_accumulate_into(self._wide, id(p), p.dtype))
                )
            compat.set_tensor(self.replica, name, leaf, parameter=True)
        self._tie()

    def _reduce(self) -> None:
        world = world_size()
        for name, p in self.params.items():
            if not p.requires_grad:
                continue
            g = self._wide.get(id(p), self.replica.get_parameter(name).grad)
            g = torch.zeros_like(self.replica.get_parameter(name)) if g is None else g
            g = g.to(p.dtype) / world  # FSDP2 averages over ranks
            shard = compat.reduce_scatter_like(g, p)
            p.grad = shard if p.grad is None else p.grad + shard

    def _release(self) -> None:
        """Drop the full parameters (the replica keeps meta placeholders between steps)."""
        for hook in getattr(self, "_hooks", ()):
            hook.remove()
        self._hooks, self._wide = [], {}
        for name, p in self.params.items():
            placeholder = nn.Parameter(torch.empty(p.shape, dtype=self.param_dtype or p.dtype, device="meta"))
            compat.set_tensor(self.replica, name, placeholder, parameter=True)
        self._tie()

    def _tie(self) -> None:
        if getattr(self.replica.config, "tie_word_embeddings", False):
            self.replica.tie_weights()


class AliasReplica:
    """A copy of a module whose parameters alias the model's own storage (nothing is copied).

    Autograd through the replica accumulates into the replica's gradients and never reaches the
    model's parameters, so hooks an engine registered on them (DeepSpeed ZeRO's gradient reduction,
    which refuses a parameter reduced twice per micro-step) do not fire during the tree's many
    backwards. The step's gradient is then handed to the engine with one backward of
    :meth:`gradient_surrogate` through the engine's own ``backward``.

    Under DeepSpeed ZeRO-3 (partitioned parameters), :meth:`whole` gathers them with ``gather`` and
    DeepSpeed's own gather hooks are left off the replica (nothing collective runs in a unit).

    Args:
        model: the module the engine trains (a transformers causal LM, a PEFT model, ...): whole
            parameters, or ZeRO-3 partitions.
        accumulate_dtype: accumulate the tree's gradient in this dtype where parameters are of a
            narrower floating dtype (e.g. ``torch.float32`` for bf16 parameters, as DeepSpeed
            accumulates micro-batches in fp32): each unit's gradient is added to an fp32 buffer as
            autograd produces it, so the step's gradient is rounded to the parameter dtype once, in
            the surrogate's backward, instead of once per unit. None: the parameter dtype.
        gather: for partitioned parameters, the engine's context that makes a list of them whole
            (one collective, the same on every rank) and partitions them again on exit, e.g.
            :func:`forkrl.plugins.deepspeed.gathered` (core imports no engine).

    Raises:
        ValueError: for a model with ZeRO-3 partitions and no ``gather``.
    """

    def __init__(
        self, model: nn.Module, accumulate_dtype: torch.dtype | None = None, gather: Gather | None = None
    ) -> None:
        self.model = model
        self.accumulate_dtype = accumulate_dtype
        self.locations = list(model.named_parameters(remove_duplicate=False))
        memo: dict[int, object] = {id(b): b for _, b in model.named_buffers(remove_duplicate=False)}
        for _, p in self.locations:
            shape = compat.whole_shape(p)
            memo.setdefault(
                id(p), nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), p.requires_grad)
            )
        self._placeholders = {name: memo[id(p)] for name, p in self.locations}
        self.partitioned = list({id(p): p for _, p in self.locations if compat.is_zero3_param(p)}.values())
        if self.partitioned and gather is None:
            raise ValueError(
                f"{type(model).__name__}'s parameters are DeepSpeed ZeRO-3 partitions: pass gather= (the engine's "
                "gathering context, forkrl.plugins.deepspeed.gathered) so the tree step can make them whole"
            )
        self.gather = gather
        self.replica = copy.deepcopy(model, memo)
        for sub in self.replica.modules():
            # A host's forward patched onto an instance (TRL's fused LM head) closes over the
            # original module, whose forward would run the engine's hooks: the class's own forward.
            vars(sub).pop("forward", None)
        # DeepSpeed's per-module ZeRO-3 gather/release hooks would fetch and free the model's partitions.
        for hooks, key in compat.engine_hooks_of(self.replica, "deepspeed"):
            del hooks[key]
        self.grads: dict[int, torch.Tensor] = {}
        self._whole_depth = 0

    @contextmanager
    def whole(self) -> Iterator[None]:
        """ZeRO-3: every partitioned parameter all-gathered once for the context, partitioned again
        on exit (re-entrant: only the outermost context gathers). Otherwise nothing happens.

        Step the engine's optimizer outside it: a step inside would update the partitions under
        whole copies that the exit then discards, or that a later forward reads stale."""
        outer = self._whole_depth == 0 and bool(self.partitioned)
        self._whole_depth += 1
        try:
            with self.gather(self.partitioned) if outer else contextlib.nullcontext():
                yield
        finally:
            self._whole_depth -= 1

    @contextmanager
    def gathered(self, grad: bool) -> Iterator[nn.Module]:
        """The replica holding the model's parameters (aliased); with ``grad``, their gradients
        are kept in :attr:`grads` (by parameter id) on exit."""
        with self.whole():
            yield from self._aliased(grad)

    def _aliased(self, grad: bool) -> Iterator[nn.Module]:
        aliases: dict[int, nn.Parameter] = {}
        wide: dict[int, torch.Tensor] = {}
        hooks = []
        for name, p in self.locations:
            leaf = aliases.get(id(p))
            if leaf is None:
                leaf = aliases[id(p)] = nn.Parameter(p.detach(), requires_grad=grad and p.requires_grad)
                if leaf.requires_grad and self._widens(leaf):
                    hooks.append(leaf.register_post_accumulate_grad_hook(self._accumulator(id(p), wide)))
            compat.set_tensor(self.replica, name, leaf, parameter=True)
        self.replica.train(self.model.training)
        try:
            yield self.replica
            if grad:
                self.grads = {key: leaf.grad for key, leaf in aliases.items() if leaf.grad is not None}
                self.grads.update(wide)
        finally:
            for hook in hooks:
                hook.remove()
            for name, placeholder in self._placeholders.items():
                compat.set_tensor(self.replica, name, placeholder, parameter=True)

    def _widens(self, p: torch.Tensor) -> bool:
        return self.accumulate_dtype is not None and _narrower(p.dtype, self.accumulate_dtype)

    def _accumulator(self, key: int, wide: dict[int, torch.Tensor]):
        return _accumulate_into(wide, key, self.accumulate_dtype)

    def gradient_surrogate(self, zero: bool = False) -> torch.Tensor:
        """A scalar (value 0) whose gradient w.r.t. each trainable model parameter is its gradient
        in :attr:`grads` (zero where it has none, or everywhere with ``zero``).

        Backward it through the engine (``engine.backward(surrogate)``) to give the engine the tree
        step's gradient as if the host's own backward had produced it. A gradient kept in a wider
        dtype (``accumulate_dtype``) is rounded to the parameter's dtype there, once.

        Under ZeRO-3 the surrogate reaches the parameters only inside :meth:`whole` (their
        gradients must have the whole shape); ``zero`` there gives a scalar that reaches no
        parameter at all (the engine's backward runs, reduces nothing, and keeps what it holds).

        Raises:
            RuntimeError: for a ZeRO-3 model outside :meth:`whole` (with gradients to hand over).
        """
        if self.partitioned and zero:
            device = getattr(self.partitioned[0], "ds_tensor", self.partitioned[0]).device
            return torch.zeros((), device=device, requires_grad=True) * 1.0
        if self.partitioned and self._whole_depth == 0:
            raise RuntimeError(
                "AliasReplica.gradient_surrogate: this model's parameters are ZeRO-3 partitions; build and "
                "backward the surrogate inside AliasReplica.whole() so its gradients have the whole shape"
            )
        terms = []
        seen: set[int] = set()
        for _, p in self.locations:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            g = None if zero else self.grads.get(id(p))
            delta = p - p.detach()  # value 0, gradient 1
            terms.append((delta.to(g.dtype) * g).sum() if g is not None else (delta * 0).sum())
        if not terms:
            raise ValueError("the model has no trainable parameters: nothing to hand to the engine")
        return torch.stack([t.float() for t in terms]).sum()

    def clear(self) -> None:
        """Drop the kept gradients (after they were handed over)."""
        self.grads = {}


def _narrower(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Whether floating ``dtype`` has fewer bits than floating ``than``."""
    return (
        dtype.is_floating_point
        and than.is_floating_point
        and torch.finfo(dtype).bits < torch.finfo(than).bits
    )


def _accumulate_into(wide: dict[int, torch.Tensor], key: int, dtype: torch.dtype):
    """A post-accumulate-grad hook that moves each gradient autograd leaves on a parameter into
    ``wide[key]`` (a ``dtype`` sum), so that a narrow parameter's gradient is summed in ``dtype``."""

    def add(leaf: torch.Tensor) -> None:
        if key in wide:
            wide[key].add_(leaf.grad)
        else:
            wide[key] = leaf.grad.to(dtype)
        leaf.grad = None

    return add
