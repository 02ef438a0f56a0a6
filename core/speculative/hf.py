"""The Hugging Face engine of self-speculative rollout: batched exact speculative sampling.

A :class:`~forkrl.core.quant.Drafter` (the policy, weight-quantized) proposes ``k`` tokens per
sequence; the policy scores all of them in one forward; :func:`~.accept.speculative_accept` keeps
a prefix of them so that the output distribution is exactly the policy's.
:class:`~.policy.SpeculationPolicy` decides, step by step, whether speculating pays on this machine
for the current number of active sequences, and how many tokens to draft.

Batching. Every sequence accepts its own number of tokens. Both models keep a key/value cache of
fixed capacity in which row ``b`` holds its tokens in columns ``0 .. len_b - 1`` (the prompt, left-
padded as given, then the completion); a forward writes row ``b``'s new tokens at its own column
``len_b`` and attends through a 4D mask, with explicit position ids. Rolling a row back is
therefore free: its length goes down and the stale columns are overwritten later. Finished rows
(EOS or ``max_new_tokens``) leave the batch and both caches at the end of the step.

Cache invariants between steps (``s`` = the row's tokens so far): the policy's cache holds all of
``s`` but its last token; the drafter's holds all of ``s`` but its last ``lag`` tokens, where
``lag`` is the same for every row (2 after a speculative step, one more after each plain step,
and the drafter is only prefilled when speculation first turns on).
"""

from __future__ import annotations

import math
import numbers
import time

import torch
from torch import nn

from ..quant import Drafter, unwrap
from .accept import greedy_accept, speculative_accept
from .policy import Decision, SpeculationPolicy
from .ragged import Batch, Runner, Sampling, check_full_attention
from .stats import SpeculativeOutput, SpeculativeStats

__all__ = ["SpeculativeSampler"]


class SpeculativeSampler:
    """Batched generation from ``model``, speculating with ``drafter`` where ``policy`` says it pays.

    Sampling is exact: the sequences have the distribution of plain sampling from ``model`` with
    the same temperature/top-k/top-p, and greedy decoding returns the tokens of
    ``model.generate(do_sample=False)`` (up to floating-point ties of the argmax).

    Args:
        model: a Hugging Face causal LM with full attention ('sdpa' or 'eager'), possibly wrapped
            (DDP / DeepSpeed ``.module``); its ``generation_config`` supplies EOS and pad ids.
        drafter: its :class:`Drafter` (None only with ``SpeculationPolicy.never()``).
        policy: when and how far to speculate; default ``SpeculationPolicy.fixed(4)``.
    """

    def __init__(
        self, model: nn.Module, drafter: Drafter | None, policy: SpeculationPolicy | None = None
    ) -> None:
        self.model = unwrap(model)
        self.generation_config = getattr(self.model, "generation_config", None)
        self.policy = policy or (
            SpeculationPolicy.fixed(4) if drafter is not None else SpeculationPolicy.never()
        )
        if drafter is None and self.policy.mode != "never":
            raise ValueError(
                "a drafter is needed to speculate: pass Drafter.from_policy(model), or SpeculationPolicy.never()"
            )
        self.drafter = drafter
        check_full_attention(self.model, "model")
        if drafter is not None:
            self._check_drafter(drafter)

    def _check_drafter(self, drafter: Drafter) -> None:
        v_model = self.model.config.get_text_config().vocab_size
        v_draft = drafter.config.get_text_config().vocab_size
        if v_model != v_draft:
            raise ValueError(
                f"the drafter has vocab_size={v_draft} but the model {v_model}: build it with Drafter.from_policy(model)"
            )
        if not drafter.matches(self.model):
            raise ValueError(
                "the drafter was built from a model with different parameter names/shapes (another architecture); "
                "build it with Drafter.from_policy(model) from this model"
            )

    def _special_ids(self, eos_token_id, pad_token_id) -> tuple[list[int], int]:
        gc = self.generation_config
        if eos_token_id is None and gc is not None:
            eos_token_id = gc.eos_token_id
        eos = (
            []
            if eos_token_id is None
            else [eos_token_id]
            if isinstance(eos_token_id, int)
            else list(eos_token_id)
        )
        if pad_token_id is None and gc is not None:
            pad_token_id = gc.pad_token_id
        if pad_token_id is None:
            pad_token_id = eos[0] if eos else 0
        return [int(e) for e in eos], int(pad_token_id)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        do_sample: bool | None = None,
    ) -> SpeculativeOutput:
        """Sample completions for a batch of prompts.

        Args:
            input_ids: ``[B, P]`` prompts, left-padded.
            attention_mask: ``[B, P]`` 1 for prompt tokens, 0 for padding (default all ones).
            max_new_tokens: completion budget per row (>= 1).
            temperature: sampling temperature; 0 means greedy.
            top_k: keep the k most likely tokens (None/0: off), applied after temperature.
            top_p: nucleus mass (None/1.0: off), applied after top-k.
            eos_token_id: id or ids that end a completion; None takes the model's generation
                config; ``[]`` disables EOS.
            pad_token_id: fills the completion after its end; None takes the generation config,
                else the first EOS id, else 0.
            generator: random source (seeded runs are deterministic).
            do_sample: False forces greedy (as in HF generate); None samples unless temperature == 0.

        Returns:
            :class:`SpeculativeOutput` with ``sequences [B, P + T]``, ``completion_lengths [B]``, ``stats``.
        """
        t_start = time.perf_counter()
        _check_sampling(max_new_tokens, temperature, top_k, top_p)
        input_ids, attention_mask = self._check_inputs(input_ids, attention_mask)
        greedy = do_sample is False or temperature == 0
        sampling = Sampling(greedy, temperature if temperature > 0 else 1.0, top_k, top_p, generator)
        eos, pad = self._special_ids(eos_token_id, pad_token_id)
        eos_t = torch.tensor(eos, dtype=torch.long, device=input_ids.device)
        policy = self.policy
        bsz, plen = input_ids.shape
        spec_on = self.drafter is not None and policy.mode != "never"
        capacity = plen + max_new_tokens + (policy.max_draft if spec_on else 0)
        stats = SpeculativeStats(
            kernel=self.drafter.kernel if self.drafter is not None else "none", policy_mode=policy.mode
        )
        batch = Batch(input_ids, attention_mask, capacity)
        target = Runner(self.model, capacity, "model")
        draft = Runner(self.drafter.model, capacity, "drafter") if spec_on else None
        completions = torch.full((bsz, max_new_tokens), pad, dtype=torch.long, device=input_ids.device)
        lengths = torch.zeros(bsz, dtype=torch.long, device=input_ids.device)
        limit = plen + max_new_tokens

        def settle(old_len: torch.Tensor, n_new: torch.Tensor) -> None:
            """Advance rows by n_new tokens, cut at the first EOS and the budget, retire finished rows."""
            span = int(n_new.max())
            cols = (old_len[:, None] + torch.arange(span, device=old_len.device)).clamp(max=capacity - 1)
            in_step = torch.arange(span, device=old_len.device) < n_new[:, None]
            is_eos = torch.isin(batch.tokens.gather(1, cols), eos_t) & in_step
            has_eos = is_eos.any(-1)
            new_len = torch.where(has_eos, old_len + is_eos.to(torch.int8).argmax(-1) + 1, old_len + n_new)
            new_len = new_len.clamp(max=limit)
            batch.seq_len = new_len
            done = has_eos | (new_len >= limit)
            if bool(done.any()):
                idx = done.nonzero()[:, 0]
                n = new_len[idx] - plen
                seg = batch.tokens[idx, plen:limit]  # [D, max_new_tokens]
                seg = torch.where(torch.arange(max_new_tokens, device=seg.device) < n[:, None], seg, pad)
                completions[batch.rows[idx]] = seg
                lengths[batch.rows[idx]] = n
                keep = (~done).nonzero()[:, 0]
                batch.select(keep)
                target.select(keep)
                if draft is not None:
                    draft.select(keep)

        # Prefill: the whole prompt through the target; its last logits give the first token.
        logits = target.forward(batch, torch.zeros(bsz, dtype=torch.long, device=input_ids.device), plen, 1)
        batch.put(batch.seq_len, sampling.next_token(logits[:, -1]))
        old = batch.seq_len
        settle(old, torch.ones_like(old))
        lag = plen + 1  # the drafter has seen nothing yet

        while batch.size:
            remaining = int((limit - batch.seq_len).max())
            decision = (
                policy.decide(batch.size, max_k=remaining - 1, lag=lag, horizon=remaining)
                if spec_on
                else Decision(0, float("nan"), float("nan"), batch.size)
            )
            k = decision.k
            stats.decisions.append(decision)
            stats.draft_length_history.append(k)
            stats.batch_size_history.append(batch.size)
            seq_len = batch.seq_len
            if k == 0:
                # Plain step: the pending token through the target, one new token from p.
                logits = target.forward(batch, seq_len - 1, 1, 1)[:, -1]
                batch.put(seq_len, sampling.next_token(logits))
                lag += 1
                settle(seq_len, torch.ones_like(seq_len))
                continue
            n, nxt = self._speculate(batch, target, draft, sampling, k, lag)
            lag = 2
            batch.put(seq_len + n, nxt)
            accepted = int(n.sum())
            stats.proposed += k * batch.size
            stats.accepted += accepted
            stats._spec_row_steps += batch.size
            policy.observe(accepted, int((n < k).sum()))
            settle(seq_len, n + 1)

        steps = len(stats.draft_length_history)
        if stats.proposed:
            stats.acceptance_rate = stats.accepted / stats.proposed
            stats.mean_accepted_length = (stats.accepted + stats._spec_row_steps) / stats._spec_row_steps
        stats.speculated_fraction = sum(1 for k in stats.draft_length_history if k) / steps if steps else 0.0
        stats.target_calls, stats.drafter_calls = target.calls, draft.calls if draft is not None else 0
        stats.generated_tokens = int(lengths.sum())
        stats.final_alpha = policy.alpha
        width = int(lengths.max())
        sequences = torch.cat([input_ids, completions[:, :width]], 1)
        stats.wall_time_s = time.perf_counter() - t_start
        return SpeculativeOutput(sequences, lengths, stats)

    def _speculate(
        self, batch: Batch, target: Runner, draft: Runner, sampling: Sampling, k: int, lag: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One speculative step: k drafts per row, one verifying target forward, acceptance.

        Returns:
            ``(n_accepted [B], next_token [B])``; drafts are already in ``batch.tokens`` at
            columns ``seq_len .. seq_len + k - 1``.
        """
        seq_len = batch.seq_len
        drafts, qs = [], []
        # The drafter first catches up on the last `lag` tokens, then feeds its own drafts.
        logits = draft.forward(batch, seq_len - lag, lag, 1)[:, -1]
        for j in range(k):
            if j:
                logits = draft.forward(batch, seq_len + j - 1, 1, 1)[:, -1]
            if sampling.greedy:
                d = logits.argmax(-1)
            else:
                q = sampling.probs(logits)  # [B, V]
                d = sampling.draw(q)
                qs.append(q)
            batch.put(seq_len + j, d)
            drafts.append(d)
        drafts = torch.stack(drafts, 1)  # [B, k]
        # Verify: the pending token and the k drafts in one target forward -> p at k + 1 positions.
        t_logits = target.forward(batch, seq_len - 1, k + 1, 0)  # [B, k + 1, V]
        if sampling.greedy:
            return greedy_accept(drafts, t_logits)
        p = sampling.probs(t_logits.reshape(-1, t_logits.shape[-1])).reshape(t_logits.shape)
        return self._accept(drafts, torch.stack(qs, 1), p, sampling.generator)

    def _accept(
        self, drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Acceptance rule (overridable for negative-control tests): :func:`speculative_accept`."""
        return speculative_accept(drafts, q, p, generator)

    def _check_inputs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be a [batch, prompt_len] tensor, got {getattr(input_ids, 'shape', type(input_ids))}: "
                "left-pad the prompts into one 2D tensor"
            )
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(
                f"empty prompt batch {tuple(input_ids.shape)}: every row needs at least one prompt token"
            )
        if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
        device = self.model.get_input_embeddings().weight.device
        input_ids = input_ids.to(device=device, dtype=torch.long)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}: "
                "pass the mask of the same padded batch"
            )
        attention_mask = attention_mask.to(device)
        empty = (attention_mask.sum(-1) == 0).nonzero()[:, 0].tolist()
        if empty:
            raise ValueError(
                f"rows {empty} of attention_mask are all padding: every prompt needs at least one token"
            )
        # Left padding only: a 0 after a 1 would put padding inside the context the sampler attends to.
        mask = attention_mask.bool()
        not_left = (mask[:, :-1] & ~mask[:, 1:]).any(-1).nonzero()[:, 0].tolist()
        if not_left:
            raise ValueError(
                f"rows {not_left} of attention_mask have padding after a prompt token: the sampler takes left-padded "
                "prompts (padding first, then the prompt's tokens): left-pad them (tokenizer.padding_side='left')"
            )
        vocab = self.model.config.get_text_config().vocab_size
        if int(input_ids.max()) >= vocab or int(input_ids.min()) < 0:
            raise ValueError(
                f"input_ids hold ids outside [0, {vocab}): check the tokenizer matches the model"
            )
        return input_ids, attention_mask


def _check_sampling(max_new_tokens, temperature, top_k, top_p) -> None:
    """Raise ValueError naming the argument for a budget or sampling setting that is not valid."""
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, numbers.Integral)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not (math.isfinite(temperature) and temperature >= 0)
    ):
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0: greedy)")
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0
    ):
        raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0 or None: off)")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not (0 < top_p <= 1)
    ):
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (None or 1.0: off)")
