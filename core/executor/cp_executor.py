"""A forest's long prompts split over a context-parallel group, behind :class:`TreeExecutor`'s API.

Every rank of the group holds the same forest (a host's sequence-parallel group hands its ranks the
same rows). Each prompt and its responses run as one unit (:meth:`ContextParallelExecutor._trees`):
the prompt (the shared tokens before its sequences' first scored ones) is sharded over the group by :class:`ContextParallelReplay`; the responses are
dealt to the ranks by length (each computes its own, attending to every shard). The per-sequence
results are then summed over the group (each value comes from one rank, the others add zeros), so
every rank returns every sequence's log-probs, as a :class:`TreeExecutor` on one device would.

:meth:`backward` accumulates the gradient of the whole forest into ``param.grad``: with
``reduce_grads`` on every rank holds all of it (the group's shares summed once per call); off, each
rank holds its own share, for a host whose own gradient reduction sums over the group.

Ranks that hold different rows (``rows="own"``: TRL's data-parallel ranks grouped, each with its
own rollouts) train the union of the group's rows, gathered by the caller
(:class:`forkrl.core.train.union.GroupRows`). Each rank's loss gives coefficients for its own rows
only (zeros elsewhere); :meth:`combine` sums them over the group, so every rank replays with the
whole union's, and each rank keeps its share of the gradient: the data-parallel average over the
world (DDP's, or an engine's) then equals the average of every rank's own-rows gradient, stock's.

Not here (refused with the alternative): token-local coefficients (the caller scores first, as
:func:`forkrl.core.objective.backward_window`'s general path does), MoE router losses and images.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..tree.forest import PrefixForest
from .context_parallel import ContextParallelReplay
from .tree_executor import ScoreResult

__all__ = ["ContextParallelExecutor"]


class ContextParallelExecutor:
    """:meth:`score` and :meth:`backward` of :class:`TreeExecutor` over a context-parallel group.

    Args:
        model: the causal LM, the same on every rank (context-parallel replay's models).
        group: the process group the prompts are split over (None: the world).
        block_size, prompt_grad, temperature, schedule: as :class:`ContextParallelReplay`.
        reduce_grads: sum the forest's gradient over the group (module docstring).
        rows: ``"shared"``: the group's ranks hold the same rows; ``"own"``: each its own, the
            forest is their union and :meth:`combine` sums the coefficients (then the gradient is
            never summed here: each rank keeps its share).
    """

    def __init__(
        self,
        model: nn.Module,
        group=None,
        block_size: int | None = None,
        prompt_grad: str = "exact",
        temperature: float = 1.0,
        schedule: str = "parallel",
        reduce_grads: bool = True,
        rows: str = "shared",
    ) -> None:
        if rows not in ("shared", "own"):
            raise ValueError(f"rows={rows!r} must be 'shared' or 'own'")
        self.replay = ContextParallelReplay(
            model, group, block_size, prompt_grad, temperature, reduce_grads=False, schedule=schedule
        )
        self.group = group
        self.rows = rows
        self.reduce_grads = reduce_grads and rows == "shared"

    @property
    def device(self) -> torch.device:
        return self.replay.device

    @property
    def dtype(self) -> torch.dtype:
        return self.replay.adapter.values_dtype

    @property
    def adapter(self):
        return self.replay.adapter

    @contextlib.contextmanager
    def images(self, vision) -> Iterator[None]:
        if vision is not None:
            raise ValueError(
                "context-parallel long-context replay does not take images: train a vision-language model "
                "with long_context_replay on one device (no context-parallel group)"
            )
        yield

    def combine(
        self, losses: Sequence[torch.Tensor], g_lp: list[torch.Tensor], g_ent: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The coefficients :meth:`backward` takes, from this rank's loss gradient (per micro-batch
        ``[N_i]`` tensors, :func:`~forkrl.core.objective.backward_window`'s): as they are with
        ``rows="shared"``; with ``"own"`` summed over the group (each rank's are zero at the other
        ranks' rows), entropies None when no rank's loss reads them, and a non-finite loss on any
        rank turned into NaN coefficients on every rank, so that every rank refuses the step
        together (before its first pass)."""
        if self.rows == "shared":
            return g_lp, g_ent
        sizes = [len(g) for g in g_lp]
        ent = g_ent if g_ent is not None else [torch.zeros_like(g) for g in g_lp]
        finite = bool(torch.isfinite(torch.stack([x.detach().float() for x in losses]).sum()))
        flag = torch.zeros(1, dtype=g_lp[0].dtype, device=g_lp[0].device) + (0.0 if finite else float("nan"))
        flat = torch.cat([flag, *g_lp, *ent])  # [1 + 2N]
        dist.all_reduce(flat, group=self.group)
        flat = flat[1:] + flat[:1]  # NaN everywhere when any rank's loss was not finite
        total = sum(sizes)
        lp, en = flat[:total].split(sizes), flat[total:].split(sizes)
        return list(lp), (list(en) if bool((flat[total:] != 0).any()) else None)

    def score(self, forest: PrefixForest, entropy: bool = False, router=None, vision=None) -> ScoreResult:
        """Every sequence's log-probs (and entropies) of ``forest``, without grad, on every rank."""
        self._refuse(router, vision)
        return self._pass(forest, None, None, entropy)

    def backward(
        self,
        forest: PrefixForest,
        grad_logprobs: Sequence[torch.Tensor] | None = None,
        grad_entropies: Sequence[torch.Tensor] | None = None,
        coefficient_fn=None,
        entropy: bool = False,
        router=None,
        vision=None,
    ) -> ScoreResult:
        """Accumulate the gradient of ``sum_i sum_t grad_logprobs[i][t] * logprob_i[t]`` (plus the
        same with entropies) into ``param.grad``, as :meth:`TreeExecutor.backward` does.

        Args:
            grad_logprobs: one ``[len_i - score_from_i]`` tensor per sequence, the same on every rank.
            grad_entropies: same shapes, or None.
        """
        self._refuse(router, vision)
        if coefficient_fn is not None or grad_logprobs is None:
            raise ValueError(
                "context-parallel replay takes per-token coefficients (grad_logprobs), not a coefficient_fn: "
                "score first and pass the loss's gradient (backward_window's 'general' path)"
            )
        if len(grad_logprobs) != forest.num_sequences:
            raise ValueError(f"{len(grad_logprobs)} coefficient tensors for {forest.num_sequences} sequences")
        entropy = entropy or grad_entropies is not None
        res = self._pass(forest, grad_logprobs, grad_entropies, entropy)
        if self.reduce_grads:
            self.replay.sum_grads()  # once per forest, not per tree
        return res

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _refuse(router, vision) -> None:
        if router is not None:
            raise ValueError(
                "context-parallel long-context replay has no MoE router loss: set the router loss coefficient to 0, "
                "or train on one device (no context-parallel group)"
            )
        if vision is not None:
            raise ValueError("context-parallel long-context replay does not take images (see images())")

    def _trees(self, forest: PrefixForest) -> list[tuple[torch.Tensor, list[int], int]]:
        """Per prompt: its tokens, its sequences, and its length.

        A sequence's prompt ends at the deepest node of its path that lies wholly before its first
        scored token; a sequence whose such node lies below another's shares that one's prompt (a
        late-scored response). Distinct prompts that share only a head (a chat template's system
        turn, one forest of several ranks' rows) stay distinct: each is split over the group whole,
        and the head is computed once per prompt.
        """
        keys: dict[int, int] = {}
        for s, path in enumerate(forest.paths):
            unscored = [n for n in path if forest.nodes[n].end <= forest.score_from[s]]
            keys[s] = unscored[-1] if unscored else path[0]
        chosen = set(keys.values())
        by_key: dict[int, list[int]] = {}
        for s, path in enumerate(forest.paths):
            key = next(n for n in path if n in chosen)  # the shallowest prompt on the path
            by_key.setdefault(key, []).append(s)
        trees = []
        for key, seqs in by_key.items():
            length = min([forest.nodes[key].end] + [forest.score_from[s] for s in seqs])
            trees.append((forest.sequence_tokens(seqs[0])[:length], seqs, length))
        return trees

    def _deal(self, seqs: list[int], forest: PrefixForest, length: int) -> list[int]:
        """This rank's sequences of a tree: the longest responses first, each to the least loaded rank."""
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        load, mine = [0] * world, []
        for s in sorted(seqs, key=lambda s: (-(forest.lengths[s] - length), s)):
            if forest.lengths[s] <= length:
                continue  # nothing after the prompt: no scored token
            r = min(range(world), key=lambda r: (load[r], r))
            load[r] += forest.lengths[s] - length
            if r == rank:
                mine.append(s)
        return mine

    def _pass(self, forest, grad_logprobs, grad_entropies, entropy: bool) -> ScoreResult:
        device, dtype = self.device, self.dtype
        sizes = [n - f for n, f in zip(forest.lengths, forest.score_from, strict=True)]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        flat = torch.zeros(
            2 if entropy else 1, offsets[-1], dtype=dtype, device=device
        )  # [lp (, ent), tokens]
        for prompt, seqs, length in self._trees(forest):
            mine = self._deal(seqs, forest, length)
            responses = [forest.sequence_tokens(s)[length:] for s in mine]
            if grad_logprobs is None:
                res = self.replay.score(prompt, responses, entropy=entropy)
            else:
                coefs = [self._padded(grad_logprobs[s], forest, s, length) for s in mine]
                ent_coefs = None
                if grad_entropies is not None:
                    ent_coefs = [self._padded(grad_entropies[s], forest, s, length) for s in mine]
                elif entropy:
                    ent_coefs = [torch.zeros_like(c) for c in coefs]
                res = self.replay.backward(prompt, responses, coefs, ent_coefs)
            for k, s in enumerate(mine):
                skip = forest.score_from[s] - length
                flat[0, offsets[s] : offsets[s + 1]] = res.logprobs[k][skip:].to(dtype)
                if entropy:
                    flat[1, offsets[s] : offsets[s + 1]] = res.entropies[k][skip:].to(dtype)
        dist.all_reduce(flat, group=self.group)  # each value from its one rank, zeros elsewhere
        per_seq = [list(row.split(sizes)) for row in flat]
        ent = per_seq[1] if entropy else None
        return ScoreResult(
            per_seq[0], ent, _entries(forest, per_seq[0]), None if ent is None else _entries(forest, ent)
        )

    @staticmethod
    def _padded(coef: torch.Tensor, forest: PrefixForest, s: int, length: int) -> torch.Tensor:
        """``[len_s - score_from_s]`` coefficients -> ``[len_s - length]`` (zeros before the scored tokens)."""
        out = torch.zeros(forest.lengths[s] - length, dtype=coef.dtype, device=coef.device)
        out[forest.score_from[s] - length :] = coef
        return out.detach()


def _entries(forest: PrefixForest, per_sequence: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence values -> ``[num_entries]`` (a shared entry's sequences hold the same value)."""
    flat = torch.cat(per_sequence) if per_sequence else torch.zeros(0)
    out = torch.zeros(forest.num_entries, dtype=flat.dtype, device=flat.device)
    out[forest.entry_index(flat.device)] = flat
    return out
