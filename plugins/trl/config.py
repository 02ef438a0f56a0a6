"""forkrl's configs for TRL: TRL's GRPO/RLOO configs plus the tree-training and long-context flags.

The subclasses only add fields (precedent: TRL's ``experimental/gmpo``); every TRL field keeps its
meaning and default. The trainers read them (see :mod:`forkrl.plugins.trl.trainer`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig as _TRLGRPOConfig
from trl import RLOOConfig as _TRLRLOOConfig

__all__ = ["FORKRL_FIELDS", "GRPOConfig", "RLOOConfig", "SPECULATIVE_POLICIES", "TREE_MODES", "TreeOptions"]

TREE_MODES = ("auto", "keep", "replay", "packed")
_PROMPT_GRADS = ("exact", "none")
SPECULATIVE_POLICIES = ("auto", "always")


@dataclass
class TreeOptions:
    """forkrl's flags, shared by the GRPO and RLOO configs.

    Parameters:
        tree_packing: train all sequences of an optimizer step as one prefix forest.
        tree_mode: ``"auto"``, ``"keep"``, ``"replay"`` or ``"packed"``.
        tree_block_size: replay block size in tokens.
        long_context_replay: run prompts without autograd, keep their cache, replay them with grad.
        long_context_prompt_grad: ``"exact"`` or ``"none"``.
    """

    tree_packing: bool = field(
        default=False,
        metadata={
            "help": "Train the sequences of each optimizer step (the union of its gradient-accumulation "
            "micro-batches) as one prefix tree: GRPO groups, repeated completions and shared system prompts "
            "compute their shared tokens once. The update equals stock TRL's."
        },
    )
    tree_mode: str = field(
        default="auto",
        metadata={
            "help": "How the tree is run. 'keep': each shared prefix is forwarded once and its activations kept "
            "while its branches train (fastest). 'replay': prefixes run without grad and are re-forwarded in "
            "blocks of tree_block_size tokens on the way back (memory of one block, like gradient "
            "checkpointing). 'packed': one sequence with a tree attention mask (attention-only models). "
            "'auto': replay when gradient_checkpointing is on, long_context_replay is set or a root-to-leaf "
            "path is longer than tree_replay_threshold tokens; keep otherwise.",
            "choices": list(TREE_MODES),
        },
    )
    tree_block_size: int | None = field(
        default=None,
        metadata={
            "help": "Block size in tokens for replay mode (default 2048): activation memory is that of one "
            "block, whatever the prompt length or group size."
        },
    )
    tree_replay_threshold: int = field(
        default=16384,
        metadata={
            "help": "tree_mode='auto' switches to replay when a root-to-leaf path has more tokens than this."
        },
    )
    long_context_replay: bool = field(
        default=False,
        metadata={
            "help": "Long-context replay: each prompt runs without autograd in tree_block_size blocks, only its "
            "key/value (or recurrent) cache is kept, responses train one at a time adding gradient into that "
            "cache, then the prompt is replayed with grad in reverse. Memory does not grow with the group size. "
            "Works with or without tree_packing (the update is stock TRL's either way)."
        },
    )
    long_context_prompt_grad: str = field(
        default="exact",
        metadata={
            "help": "'exact': the prompt's parameters get their exact gradient (stock TRL's update). 'none': the "
            "prompt is a constant (LongStraw's truncated gradient; faster, not stock TRL's update).",
            "choices": list(_PROMPT_GRADS),
        },
    )

    speculative_rollout: bool = field(
        default=False,
        metadata={
            "help": "Self-speculative rollouts (TRL's transformers generation, use_vllm=False): completions are "
            "drafted by a weight-quantized copy of the policy, re-derived after every optimizer step, and verified "
            "by the policy with exact rejection sampling, so they are distributed exactly as stock sampling."
        },
    )
    speculative_bits: int = field(
        default=4,
        metadata={"help": "Drafter weight bits: 4 (groupwise round-to-nearest) or 8 (per channel)."},
    )
    speculative_group_size: int = field(
        default=128,
        metadata={"help": "Drafter int4 group size (32, 64, 128 or 256; must divide the layers)."},
    )
    speculative_policy: str = field(
        default="auto",
        metadata={
            "help": "'auto': time the policy and the drafter on this machine at the first rollout and speculate only "
            "where the cost model predicts a gain, with the draft length following the acceptance rate. 'always': "
            "speculate every step with speculative_draft_len.",
            "choices": list(SPECULATIVE_POLICIES),
        },
    )
    speculative_draft_len: int = field(
        default=4, metadata={"help": "Draft length for speculative_policy='always'."}
    )
    speculative_margin: float = field(
        default=0.1,
        metadata={
            "help": "'auto' speculates only when the predicted speedup exceeds 1 + speculative_margin."
        },
    )

    @property
    def tree_enabled(self) -> bool:
        """Whether training runs through forkrl's tree executor."""
        return bool(self.tree_packing or self.long_context_replay)

    def _validate_forkrl(self) -> None:
        self._validate_speculative()
        if not isinstance(self.tree_packing, bool):
            raise ValueError(f"tree_packing must be True or False, got {self.tree_packing!r}")
        if not isinstance(self.long_context_replay, bool):
            raise ValueError(f"long_context_replay must be True or False, got {self.long_context_replay!r}")
        if self.tree_mode not in TREE_MODES:
            raise ValueError(f"tree_mode={self.tree_mode!r} is not one of {TREE_MODES}")
        if self.tree_block_size is not None and (
            isinstance(self.tree_block_size, bool)
            or not isinstance(self.tree_block_size, int)
            or self.tree_block_size < 1
        ):
            raise ValueError(f"tree_block_size={self.tree_block_size!r} must be a positive integer or None")
        if not isinstance(self.tree_replay_threshold, int) or self.tree_replay_threshold < 1:
            raise ValueError(
                f"tree_replay_threshold={self.tree_replay_threshold!r} must be a positive integer"
            )
        if self.long_context_prompt_grad not in _PROMPT_GRADS:
            raise ValueError(
                f"long_context_prompt_grad={self.long_context_prompt_grad!r} is not one of {_PROMPT_GRADS}"
            )
        if not self.tree_enabled:
            changed = [
                name
                for name in ("tree_mode", "tree_block_size", "long_context_prompt_grad")
                if getattr(self, name) != _DEFAULTS[name]
            ]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} set but tree_packing=False and long_context_replay=False, so it would have "
                    "no effect: set tree_packing=True (or long_context_replay=True), or drop the setting"
                )
            return
        if self.long_context_replay and self.tree_mode in ("keep", "packed"):
            raise ValueError(
                f"long_context_replay=True runs prompts in replay mode, which contradicts tree_mode="
                f"{self.tree_mode!r}: use tree_mode='auto' or 'replay', or set long_context_replay=False"
            )
        if self.long_context_prompt_grad == "none" and not self.long_context_replay:
            raise ValueError(
                "long_context_prompt_grad='none' only applies with long_context_replay=True: set it, or keep "
                "long_context_prompt_grad='exact'"
            )
        if self.fp16:
            raise ValueError(
                "tree_packing/long_context_replay do not support fp16 loss scaling (fp16=True): use bf16=True, or "
                "turn tree training off"
            )
        if self.deepspeed or self.fsdp:
            engine = "DeepSpeed" if self.deepspeed else "FSDP"
            raise ValueError(
                f"tree_packing/long_context_replay with {engine} is not supported yet (the tree pass computes "
                "gradients outside the engine's hooks): use plain data parallel (accelerate launch, DDP), or turn "
                "tree training off"
            )

    def _validate_speculative(self) -> None:
        if not isinstance(self.speculative_rollout, bool):
            raise ValueError(f"speculative_rollout must be True or False, got {self.speculative_rollout!r}")
        if self.speculative_bits not in (4, 8):
            raise ValueError(f"speculative_bits={self.speculative_bits!r} must be 4 or 8")
        if self.speculative_group_size not in (32, 64, 128, 256):
            raise ValueError(
                f"speculative_group_size={self.speculative_group_size!r} must be 32, 64, 128 or 256"
            )
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            raise ValueError(
                f"speculative_policy={self.speculative_policy!r} is not one of {SPECULATIVE_POLICIES}"
            )
        if not isinstance(self.speculative_draft_len, int) or self.speculative_draft_len < 1:
            raise ValueError(
                f"speculative_draft_len={self.speculative_draft_len!r} must be a positive integer"
            )
        if not self.speculative_margin >= 0:
            raise ValueError(f"speculative_margin={self.speculative_margin!r} must be >= 0")
        if not self.speculative_rollout:
            return
        if getattr(self, "use_vllm", False):
            raise ValueError(
                "speculative_rollout drives TRL's transformers generation; with use_vllm=True generation runs in "
                "vLLM (its speculative path is a later forkrl release): set use_vllm=False or speculative_rollout=False"
            )
        if getattr(self, "use_transformers_continuous_batching", False):
            raise ValueError(
                "speculative_rollout replaces transformers' generate; it cannot run inside continuous batching: set "
                "use_transformers_continuous_batching=False or speculative_rollout=False"
            )
        unsupported = []
        if getattr(self, "min_p", None) is not None:
            unsupported.append(f"min_p={self.min_p}")
        if getattr(self, "repetition_penalty", 1.0) != 1.0:
            unsupported.append(f"repetition_penalty={self.repetition_penalty}")
        extra = set(getattr(self, "generation_kwargs", None) or {}) - {"do_sample"}
        if extra:
            unsupported.append(f"generation_kwargs {sorted(extra)}")
        if unsupported:
            raise ValueError(
                f"speculative_rollout samples exactly with temperature, top_k and top_p only; {', '.join(unsupported)} "
                "would change the distribution it must reproduce: drop them or set speculative_rollout=False"
            )

    @classmethod
    def from_trl(cls, args: Any, **forkrl_fields: Any) -> TreeOptions:
        """A forkrl config from the stock TRL config (copied, not modified) plus forkrl's fields.

        TRL's ``__post_init__`` already ran on ``args``; it is not run again (it is not idempotent),
        only forkrl's validation runs.
        """
        unknown = set(forkrl_fields) - set(FORKRL_FIELDS)
        if unknown:
            raise TypeError(
                f"unknown forkrl option(s) {sorted(unknown)}; forkrl's options are {list(FORKRL_FIELDS)}"
            )
        host = cls.__bases__[-1]
        if not isinstance(args, host):
            raise TypeError(
                f"{cls.__name__}.from_trl needs a {host.__module__}.{host.__name__}, got {type(args).__name__}"
            )
        new = copy.copy(args)
        if not isinstance(new, cls):
            new.__class__ = cls
            for name in FORKRL_FIELDS:
                setattr(new, name, _DEFAULTS[name])
        for name, value in forkrl_fields.items():
            setattr(new, name, value)
        new._validate_forkrl()
        return new


@dataclass
class GRPOConfig(TreeOptions, _TRLGRPOConfig):
    """TRL's :class:`trl.GRPOConfig` with forkrl's flags (see :class:`TreeOptions`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._validate_forkrl()


@dataclass
class RLOOConfig(TreeOptions, _TRLRLOOConfig):
    """TRL's :class:`trl.RLOOConfig` with forkrl's flags (see :class:`TreeOptions`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._validate_forkrl()


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TreeOptions)}
FORKRL_FIELDS = tuple(_DEFAULTS)
