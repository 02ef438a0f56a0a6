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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from .. import attention, compat
from ..errors import UnsupportedModelError
from ..tree import PrefixForest
from . import levels
from .dfs import DepthFirstPass
from .head import CoefficientFn, ScoredHead, StaticCoefficients
from .model import HEAD_PRECISIONS, HeadPrecision, ModelAdapter
from .packed import check_packed, run_packed
from .router import RouterLoss, RouterPass
from .vision import VisionBatch

logger = logging.getLogger(__name__)

__all__ = [
    "MODES",
    "PROMPT_GRADS",
    "ExecMode",
    "PromptGrad",
    "RouterLoss",
    "ScoreResult",
    "TreeExecutor",
    "UnsupportedModelError",
]

ExecMode = Literal["keep", "replay", "packed"]
PromptGrad = Literal["exact", "none"]
MODES: tuple[str, ...] = get_args(ExecMode)
PROMPT_GRADS: tuple[str, ...] = get_args(PromptGrad)


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


# The first-use probe's forest: a shared prefix, a batch of two leaves, one branch a node deeper.
_PROBE = ([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3, 4, 9]], [2, 2, 3])


def _positive_int(value, name: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer" + (" or None" if allow_none else ""))


class TreeExecutor:
    """Runs a causal LM over a :class:`PrefixForest`, scoring and backpropagating each token once.

    Args:
        model: a transformers ``*ForCausalLM`` (optionally PEFT-wrapped) whose decoder accepts a
            cache built from tensors (Llama, Qwen2/3, Mistral, Gemma families; MHA, GQA, MQA; the
            multi-head latent attention of DeepSeek-V2/V3 and Kimi K2 over its latent cache).
        mode: ``"keep"``, ``"replay"`` or ``"packed"`` (module docstring).
        block_size: replay mode: the longest span forwarded at once (None: whole nodes). Also
            bounds the no-grad forward of ``score`` in every non-packed mode.
        temperature: logits are divided by it before the softmax, as the host samples.
        head_chunk_elems: at most this many logits (rows x vocab) exist at once.
        score_batch_tokens: ``score`` runs sibling leaves as one batch while batch x longest leaf
            (plus batch x context where the attention copies the context per sequence) stays under
            this.
        leaf_batch_tokens: the same bound for sibling leaves in a keep-mode gradient pass: the
            most padded leaf tokens whose activations autograd holds at once (keep mode's memory:
            the path's plus at most this many leaf tokens', whatever the group size). Replay runs
            leaves one at a time (its memory is one path's).
        prompt_grad: ``"exact"`` (default): gradients pass through every token. ``"none"``: the
            truncated gradient of LongStraw (arXiv 2607.14952): context that no sequence scores
            (prompts) runs without autograd and its hidden states and keys/values are constants;
            only the LM head still gets the gradient of the first scored token it predicts.
        split_attention: run each node's attention as an unmasked part over the ancestors' cache
            and a causal part over itself (:mod:`forkrl.core.attention`), so no ``[node, context]``
            mask is built or kept for backward and no context is copied: on the CPU with sdpa, and on
            CUDA in bf16/fp16 for models using sdpa or flash-attention (self-checked on the device
            at first use; float32 on CUDA falls back). False: the model's own attention.
        head_precision: how the host computes its log-probs from the last hidden states
            (:data:`HEAD_PRECISIONS`; :meth:`ModelAdapter.logits`): ``"model"`` (default), the LM head
            as the model's forward runs it; ``"fp32_accumulate"``, TRL's fused LM head (its gradient
            products summed in float32); ``"fp32"``, the head in float32 outside autocast.
        level_batching: keep mode on attention-only models with split attention: run the units at
            one depth of many trees as one forward (:mod:`.levels`; a GRPO step runs the decoder
            about twice per bundle of groups rather than twice per group). False: depth first.
        collapse_tokens: level batching: a node below the roots whose copies would add at most this
            many tokens of work (``len * (children - 1)``) is computed once per child instead of
            adding a depth, i.e. a decoder run (:func:`forkrl.core.tree.collapsed`). 0 (default):
            only nodes with one child (a sequence ends there), which cost nothing; 64 saves a run
            where completions share a first token, exact in float64, but with veRL's bf16
            parameters its update lies 4.4 rounding gaps from stock's (0.31 without), not yet
            understood.

    Raises:
        UnsupportedModelError: for models it cannot run in this mode, naming the alternative.
        ValueError: on a bad mode, block size or temperature.
    """

    def __init__(
        self,
        model: nn.Module,
        mode: ExecMode = "keep",
        block_size: int | None = None,
        temperature: float = 1.0,
        head_chunk_elems: int = 1 << 25,
        score_batch_tokens: int = 1 << 15,
        leaf_batch_tokens: int = 1 << 13,
        prompt_grad: PromptGrad = "exact",
        split_attention: bool = True,
        head_precision: HeadPrecision = "model",
        level_batching: bool = True,
        collapse_tokens: int = 0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        _positive_int(block_size, "block_size", allow_none=True)
        _positive_int(head_chunk_elems, "head_chunk_elems")
        _positive_int(score_batch_tokens, "score_batch_tokens")
        _positive_int(leaf_batch_tokens, "leaf_batch_tokens")
        if isinstance(collapse_tokens, bool) or not isinstance(collapse_tokens, int) or collapse_tokens < 0:
            raise ValueError(f"collapse_tokens={collapse_tokens!r} must be a non-negative integer")
        if head_precision not in HEAD_PRECISIONS:
            raise ValueError(f"head_precision={head_precision!r} must be one of {HEAD_PRECISIONS}")
        if prompt_grad not in PROMPT_GRADS:
            raise ValueError(f"prompt_grad={prompt_grad!r} must be one of {PROMPT_GRADS}")
        if prompt_grad == "none" and mode == "packed":
            raise ValueError(
                "prompt_grad='none' needs the prompt to run separately from the responses: use mode='keep' or "
                "mode='replay'"
            )
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or not (math.isfinite(temperature) and temperature > 0)
        ):
            raise ValueError(f"temperature={temperature!r} must be a positive finite number")
        self.adapter = ModelAdapter(model)
        self.model = model
        self.mode = mode
        self.block_size = block_size
        self.temperature = float(temperature)
        self.head_chunk_elems = head_chunk_elems
        self.score_batch_tokens = score_batch_tokens
        self.leaf_batch_tokens = leaf_batch_tokens
        self.prompt_grad = prompt_grad
        self.split_attention = split_attention
        self.level_batching = level_batching
        self.collapse_tokens = collapse_tokens
        self.head_precision = head_precision
        if mode == "packed":
            check_packed(self.adapter)
        self._warned_checkpointing = False
        self._bound_vision: VisionBatch | None = None  # the default of calls inside images()
        self._probed = False
        self._router_probed = False

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def score(
        self,
        forest: PrefixForest,
        entropy: bool = False,
        router: RouterLoss | None = None,
        vision: VisionBatch | None = None,
    ) -> ScoreResult:
        """Log-probs (and entropies) of every scored token, without grad.

        Args:
            forest: the batch.
            entropy: also return the entropy of each predicting distribution.
            router: a :class:`RouterLoss` bound to ``forest``: this pass also counts its top-k
                assignments (so a following :meth:`backward` needs no counting pass of its own).
            vision: the batch's images (a vision-language model; ``forest`` built from its
                ``sequences``), :class:`~forkrl.core.executor.vision.VisionBatch`.

        Returns:
            :class:`ScoreResult`, one ``[len_i - score_from_i]`` tensor per sequence.
        """
        vision = vision if vision is not None else self._bound_vision
        self._check_forest(forest, vision)
        self._check_router(forest, router)
        lp, ent = self._run(forest, grad=False, entropy=entropy, coef=None, router=router, vision=vision)
        return self._result(forest, lp, ent)

    def combine(
        self, losses: Sequence[torch.Tensor], g_lp: list[torch.Tensor], g_ent: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The coefficients :meth:`backward` takes from the loss gradient: this rank's own, as they
        are (a context-parallel group's ranks combine theirs: :class:`ContextParallelExecutor`)."""
        return g_lp, g_ent

    def backward(
        self,
        forest: PrefixForest,
        grad_logprobs: Sequence[torch.Tensor] | None = None,
        grad_entropies: Sequence[torch.Tensor] | None = None,
        coefficient_fn: CoefficientFn | None = None,
        entropy: bool = False,
        router: RouterLoss | None = None,
        vision: VisionBatch | None = None,
    ) -> ScoreResult:
        """Accumulate into ``param.grad`` the gradient of a linear functional of the log-probs.

        The functional is ``sum_i sum_t grad_logprobs[i][t] * logprob_i[t]`` (plus the same with
        entropies), computed exactly as plain per-sequence autograd would; coefficients of a token
        owned by several sequences are summed on its entry. Alternatively ``coefficient_fn``
        forms each entry's coefficients from its own log-prob during the pass (token-local
        objectives, see :mod:`forkrl.core.objective`), so no separate scoring pass is needed.
        Coefficients are constants (detached), as ``grad_tensors`` of ``torch.autograd.backward``.

        Args:
            forest: the batch.
            grad_logprobs: one ``[len_i - score_from_i]`` floating tensor per sequence.
            grad_entropies: same shapes, or None.
            coefficient_fn: instead of the two above, ``(entry_ids, logprobs, entropies) ->
                (coef_logprobs, coef_entropies)``, evaluated per chunk of entries.
            entropy: compute entropies (passed to ``coefficient_fn`` and returned); implied by
                ``grad_entropies``.
            router: a :class:`RouterLoss` bound to ``forest``: its gradient (the MoE router
                load-balancing loss of groups of the sequences, as the model computes it per
                batch) is added too. Its top-k counts come from an earlier :meth:`score` with the
                same ``router``, else from a decoder-only no-grad pass first (packed mode: the
                pass's own forward). Its values are ``router.values()`` afterwards.
            vision: the batch's images (``forest`` built from its ``sequences``): the image rows'
                gradient then flows through the vision tower once, at the end.

        Returns:
            The detached log-probs (and entropies) the pass computed.

        Raises:
            RuntimeError: when grad mode is off (``torch.no_grad()``, inference mode).
            ValueError: on coefficients of the wrong count, shape or dtype, NaN/inf coefficients,
                or token ids outside the model's vocabulary; nothing is accumulated then.
        """
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            raise RuntimeError(
                "TreeExecutor.backward was called with grad mode off (inside torch.no_grad() or "
                "torch.inference_mode()), where no gradient can be accumulated: call it outside that context "
                "(use TreeExecutor.score for no-grad log-probs); nothing was accumulated"
            )
        if (grad_logprobs is None) == (coefficient_fn is None):
            raise ValueError("give exactly one of grad_logprobs or coefficient_fn")
        vision = vision if vision is not None else self._bound_vision
        self._check_forest(forest, vision)
        self._check_router(forest, router)
        coef = coefficient_fn or self._static(forest, grad_logprobs, grad_entropies)
        entropy = entropy or grad_entropies is not None
        lp, ent = self._run(forest, grad=True, entropy=entropy, coef=coef, router=router, vision=vision)
        if vision is not None:
            vision.finish()
        return self._result(forest, lp, ent)

    @contextlib.contextmanager
    def images(self, vision: VisionBatch | None) -> Iterator[None]:
        """Calls of :meth:`score` and :meth:`backward` inside the block take ``vision`` (for a caller
        that hands the executor through layers that know nothing of images)."""
        previous, self._bound_vision = self._bound_vision, vision
        try:
            yield
        finally:
            self._bound_vision = previous

    @property
    def device(self) -> torch.device:
        """The device the model's LM head lives on (where results are returned)."""
        return self.adapter.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the values it returns: the model's for float32/float64, float32 for half types."""
        return self.adapter.values_dtype

    # ------------------------------------------------------------------ internals
    def _static(self, forest, grad_logprobs, grad_entropies) -> StaticCoefficients:
        coefs = []
        for name, values in (("grad_logprobs", grad_logprobs), ("grad_entropies", grad_entropies)):
            if values is None:
                coefs.append(None)
                continue
            try:
                c = forest.scatter_add(list(values))
            except ValueError as err:
                raise ValueError(f"{name}: {err}; nothing was accumulated") from None
            if not torch.isfinite(c).all():
                raise ValueError(
                    f"{name} contains NaN or inf (e.g. a NaN advantage): fix the rewards/advantages before the "
                    "backward pass; nothing was accumulated"
                )
            coefs.append(c.to(self.device, self.dtype))
        return StaticCoefficients(coefs[0], coefs[1])

    def _check_forest(self, forest: PrefixForest, vision: VisionBatch | None = None) -> None:
        if not isinstance(forest, PrefixForest):
            raise TypeError(f"expected a PrefixForest, got {type(forest).__name__}")
        limit = getattr(self.adapter.config, "max_position_embeddings", None)
        longest = max(forest.lengths)
        if limit is not None and longest > limit:
            s = forest.lengths.index(longest)
            raise ValueError(
                f"sequence {s} has {longest} tokens but {self.adapter.name} supports max_position_embeddings="
                f"{limit}: truncate the rollouts or raise the model's context length"
            )
        if vision is not None:  # its virtual ids lie past the vocabulary by design
            vision.check(forest, self.mode)
            return
        vocab = self.adapter.vocab_size
        top = forest.max_token
        if top >= vocab:
            s = next(i for i in range(forest.num_sequences) if int(forest.sequence_tokens(i).max()) >= vocab)
            raise ValueError(
                f"sequence {s} holds token id {top} but {self.adapter.name} has a vocabulary of {vocab}: check the "
                "tokenizer matches the model; nothing was computed"
            )

    def _result(self, forest: PrefixForest, lp: torch.Tensor, ent: torch.Tensor | None) -> ScoreResult:
        return ScoreResult(
            logprobs=forest.gather(lp),
            entropies=forest.gather(ent) if ent is not None else None,
            entry_logprobs=lp,
            entry_entropies=ent,
        )

    def _check_router(self, forest: PrefixForest, router: RouterLoss | None) -> None:
        if router is None:
            return
        if not isinstance(router, RouterLoss):
            raise TypeError(f"router must be a RouterLoss, got {type(router).__name__}")
        if router.forest is not forest:
            raise ValueError(
                "the RouterLoss is bound to another forest: call router.bind(forest, group_rows) first"
            )
        router.attach(self.model)

    def _run(
        self,
        forest: PrefixForest,
        grad: bool,
        entropy: bool,
        coef: CoefficientFn | None,
        router=None,
        vision=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.verify()
        if self.adapter.has_dropout():
            self.adapter.check_deterministic()
        if router is not None and not self._router_probed:
            self._probe_router()
        if vision is not None:
            vision.bind(forest)
        return self._pass(forest, grad, entropy, coef, router, vision)

    def verify(self) -> TreeExecutor:
        """Run the first-use probe now (see :meth:`_probe`; otherwise the first pass runs it).

        Raises:
            UnsupportedModelError: when the tree cannot reproduce the model's log-probs.
        """
        if not self._probed:
            self._probe()
        return self

    @torch.no_grad()
    def _probe(self) -> None:
        """Before the first pass: the tree's log-probs of a small forest (a shared prefix, a batch of
        two leaves, one branch deeper) must equal the model's own forward, in eval mode.

        An architecture that breaks the cache contract (attention that ignores the keys its cache
        returns, bidirectional encoders used as causal LMs, a head the adapter cannot see, masks the
        split attention cannot take) is caught here, before any gradient or state changed: with
        the split attention the pass falls back to the model's own attention (one log line) where
        that agrees; otherwise UnsupportedModelError.
        """
        self._probed = True
        forest = PrefixForest.build(*_PROBE)
        training = {m: m.training for m in self.model.modules()}
        self.model.eval()
        try:  # in the parameters' dtype, autocast off (_structural): the architecture, not rounding
            why = self._probe_error(forest)
            if why is not None and self.mode != "packed" and self.split_attention:
                self.split_attention = False
                if self._probe_error(forest) is None:
                    logger.warning(
                        "%s: forkrl's mask-free split attention disagrees with the model on a probe (%s); tree "
                        "passes use the model's own attention with a mask",
                        self.adapter.name,
                        why,
                    )
                    return
        finally:
            for m, was in training.items():
                m.training = was
        if why is not None:
            raise UnsupportedModelError(
                f"{self.adapter.name} does not follow the per-token cache contract a tree needs ({why}), so no "
                f"{self.mode}-mode tree can reproduce its log-probs: train this model without tree_packing"
            )

    def _probe_error(self, forest: PrefixForest) -> str | None:
        """None when the tree's log-probs of ``forest`` equal the model's forward, else why not."""
        try:
            with self._structural():
                return self._probe_compare(forest)
        except Exception as err:  # noqa: BLE001 - any failure on the probe is the model's incompatibility
            return f"{type(err).__name__}: {str(err)[:200]}"

    @contextlib.contextmanager
    def _structural(self) -> Iterator[None]:
        """The probes' precision: the parameters' dtype, autocast off on both sides.

        The probes check the architecture (does the tree reproduce the model's computation?), not
        rounding: in float32 or float64 parameters a broken cache contract shows at 1e-3 and more
        while agreement is 1e-6, a margin that bf16 rounding (1e-3 on log-probs, the same size as
        a broken contract in a tiny model) would erase. Autocast is therefore off for the tree pass
        and also inside the model's own forward, which a host may wrap in autocast itself
        (accelerate's mixed precision replaces ``model.forward`` by an autocast-wrapped one): hooks on
        the decoder and the LM head turn it off inside them. A model whose parameters are half
        precision is probed in that precision, with a half-precision bound.
        """
        kind = self.device.type
        entered: list[torch.autocast] = []

        def enter(module, args):
            ctx = torch.autocast(kind, enabled=False)
            ctx.__enter__()
            entered.append(ctx)

        def leave(module, args, out):
            entered.pop().__exit__(None, None, None)

        # Every part of the forward, not only decoder and head: a head transform between them (BERT's
        # cls.predictions.transform) would otherwise run in autocast's dtype into a float head.
        ad = self.adapter
        modules = list({id(m): m for m in (ad.decoder, ad.head, *ad.base.children())}.values())
        handles = [
            h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))
        ]
        try:
            with torch.autocast(kind, enabled=False):
                try:
                    yield
                finally:
                    # A forward that raised left its hook's context open: close it here, inside the
                    # outer one (closed after it, it would restore "disabled" for the whole process).
                    while entered:
                        entered.pop().__exit__(None, None, None)
        finally:
            for h in handles:
                h.remove()

    def _probe_compare(self, forest: PrefixForest) -> str | None:
        lp, _ = self._pass(forest, grad=False, entropy=False, coef=None)
        got = forest.gather(lp)
        want = []
        for seq, sf in zip(*_PROBE, strict=True):
            ids = torch.tensor([seq], device=self.device)
            logits = self.model(input_ids=ids).logits[0].to(self.dtype) / self.temperature
            want.append(torch.log_softmax(logits, -1)[sf - 1 : -1].gather(-1, ids[0, sf:, None])[:, 0])
        err = max(float((g.to(w.dtype) - w).abs().max()) for g, w in zip(got, want, strict=True))
        half = self.adapter.head.weight.dtype not in (torch.float32, torch.float64)
        tol = 5e-2 if half else 1e-9 if self.dtype == torch.float64 else 2e-4
        return None if err <= tol else f"log-probs differ from the model's forward by {err:.1e}"

    @torch.no_grad()
    def _probe_router(self) -> None:
        """Before the first router-loss pass: the tree's aux loss of a small batch must equal the
        model's own ``aux_loss`` (eval mode, parameters' dtype); else UnsupportedModelError."""
        self._router_probed = True
        forest = PrefixForest.build(*_PROBE)
        router = RouterLoss([1.0]).bind(forest, [0, forest.num_sequences])
        router.attach(self.model)
        training = {m: m.training for m in self.model.modules()}
        self.model.eval()
        try:
            with self._structural():  # see _structural: the architecture, not rounding
                self._pass(forest, grad=False, entropy=False, coef=None, router=router)
                got = float(router.values()[0])
                seqs = _PROBE[0]
                ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for b, seq in enumerate(seqs):
                    ids[b, : len(seq)], mask[b, : len(seq)] = torch.tensor(seq), 1
                out = self.model(
                    input_ids=ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    output_router_logits=True,
                )
                want = getattr(out, "aux_loss", None)
                why = None if want is not None else "the model's forward returned no aux_loss"
        except (RuntimeError, TypeError, ValueError) as err:
            why = f"{type(err).__name__}: {str(err)[:200]}"
        finally:
            for m, was in training.items():
                m.training = was
        if why is None:
            want = float(want)
            half = self.adapter.head.weight.dtype not in (torch.float32, torch.float64)
            if abs(got - want) > (5e-2 if half else 1e-5) * max(1.0, abs(want)):
                why = f"aux loss {got:.6g} on a probe batch, the model's own {want:.6g}"
        if why is not None:
            raise UnsupportedModelError(
                f"{self.adapter.name}'s router load-balancing loss is not transformers' load_balancing_loss_func "
                f"over its router logits ({why}), so forkrl cannot reproduce it on a tree: set the router loss "
                "coefficient to 0, or train without tree_packing"
            )

    def _pass(
        self,
        forest: PrefixForest,
        grad: bool,
        entropy: bool,
        coef: CoefficientFn | None,
        router: RouterLoss | None = None,
        vision: VisionBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        lp = torch.zeros(forest.num_entries, dtype=self.dtype, device=self.device)
        ent = torch.zeros_like(lp) if entropy else None
        head = ScoredHead(
            self.adapter, self.temperature, self.head_chunk_elems, lp, ent, coef, self.head_precision
        )
        with (
            self.adapter.checkpointing_off() as was_on,
            compat.out_of_place_ssm_step(self.adapter.ssm_modules),
        ):
            if was_on and not self._warned_checkpointing:
                logger.info(
                    "gradient checkpointing is on in the model; forkrl turns it off inside tree passes "
                    "(it would drop the ancestors' cache) -- use mode='replay' for the same memory saving"
                )
                self._warned_checkpointing = True
            if self.mode == "packed":
                run_packed(self.adapter, forest, grad, head, router)
                head.flush()
                return lp, ent
            ad = self.adapter
            name = attention.select(
                ad.attn_implementation, ad.layer_kinds, ad.config, self.device, self.split_attention
            )
            pieces = name is not None
            with ad.attention_implementation(name):
                if router is not None and grad and not router.counted:
                    with torch.no_grad():  # every token's top-k before the first backward
                        counting = RouterPass(router, True, self.device)
                        DepthFirstPass(self, forest, False, _NoHead(), pieces, counting, vision).run()
                passing = (
                    RouterPass(router, count=not grad, device=self.device) if router is not None else None
                )
                if self.level_batching and levels.eligible(self, grad, pieces, router, vision):
                    levels.LevelPass(self, forest, grad, head).run()
                else:
                    DepthFirstPass(self, forest, grad, head, pieces, passing, vision).run()
            head.flush()
        return lp, ent


class _NoHead:
    """The head of a router counting pass: the counts need the decoder only."""

    def unit(self, unit, hidden, grad: bool = False) -> tuple[None, None]:
        return None, None
