"""Tree-training options: the one definition every host's flags derive from.

TRL's configs inherit these fields; OpenRLHF's launcher adds them as ``--forkrl.<name>`` flags and
veRL's config subclass as a ``forkrl`` block (:func:`forkrl.core.options.add_arguments`). The names
are the same in every host, so an error message names the flag the user wrote.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from ..executor import ExecMode, PromptGrad
from ..options import changed_fields, check_fields, option

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_REPLAY_THRESHOLD",
    "TREE_MODES",
    "GroupedRanksOptions",
    "TreeMode",
    "TreeOptions",
]

TreeMode = Literal["auto", ExecMode]
TREE_MODES: tuple[str, ...] = get_args(TreeMode)
#: Replay block size in tokens when ``tree_block_size`` is not set.
DEFAULT_BLOCK_SIZE = 2048
#: ``tree_mode='auto'`` picks replay above this many tokens per path when ``tree_replay_threshold`` is not set.
DEFAULT_REPLAY_THRESHOLD = 16384


@dataclass
class TreeOptions:
    """How a host's optimizer steps are trained as prefix forests.

    Use directly (``TreeOptions(tree_packing=True)``, validated on construction) or as a mixin of a
    host config that calls :meth:`validate_tree_options` from its own ``__post_init__``.
    """

    tree_packing: bool = option(
        False,
        "Train the sequences of each optimizer step (the union of its gradient-accumulation micro-batches) as one "
        "prefix tree: GRPO groups, repeated completions and shared system prompts compute their shared tokens once. "
        "The update equals the host's own.",
    )
    tree_mode: TreeMode = option(
        "auto",
        "How the tree is run. 'keep': each shared prefix is forwarded once and its activations kept while its "
        "branches train (fastest). 'replay': prefixes run without grad and are re-forwarded in blocks of "
        "tree_block_size tokens on the way back (memory of one block, like gradient checkpointing). 'packed': one "
        "sequence with a tree attention mask (attention-only models). 'auto': replay when gradient checkpointing "
        "is on, long_context_replay is set or a root-to-leaf path is longer than tree_replay_threshold tokens; "
        "keep otherwise.",
    )
    tree_block_size: int | None = option(
        None,
        f"Block size in tokens for replay mode (default {DEFAULT_BLOCK_SIZE}): activation memory is that of one "
        "block, whatever the prompt length or group size. In keep mode it bounds only the no-grad scoring "
        "forward (old and reference log-probs); an error with tree_mode='packed', which runs whole sequences.",
    )
    tree_replay_threshold: int | None = option(
        None,
        "tree_mode='auto' switches to replay when a root-to-leaf path has more tokens than this (default "
        f"{DEFAULT_REPLAY_THRESHOLD}); an error with any other tree_mode or with long_context_replay.",
    )
    long_context_replay: bool = option(
        False,
        "Long-context replay: each prompt runs without autograd in tree_block_size blocks, only its key/value (or "
        "recurrent) cache is kept, responses train one at a time adding gradient into that cache, then the prompt "
        "is replayed with grad in reverse. Memory does not grow with the group size. Works with or without "
        "tree_packing (the update is the host's own either way).",
    )
    long_context_prompt_grad: PromptGrad = option(
        "exact",
        "'exact': the prompt's parameters get their exact gradient (the host's own update). 'none': the prompt is a "
        "constant (LongStraw's truncated gradient; faster, not the host's update).",
    )

    tree_balance: Literal["auto", "on", "off"] = option(
        "auto",
        "Balance each step's rows over the data-parallel ranks by predicted tree cost before training them "
        "(groups kept whole; TRL keeps equal rows per rank, veRL and OpenRLHF may change a rank's row count but "
        "not its micro-batch count): the slowest rank, which every rank waits for, gets cheaper. The update is "
        "unchanged where the host's loss normalisation does not depend on which rows share a rank. "
        "'auto': on with more than one rank where the host's loss allows it; 'on': refuse a loss that does not; "
        "'off': rows stay where the host put them.",
    )
    _minimums: ClassVar[dict[str, int]] = {"tree_block_size": 1, "tree_replay_threshold": 1}

    def __post_init__(self) -> None:
        self.validate_tree_options()

    @property
    def tree_enabled(self) -> bool:
        """Whether training runs through forkrl's tree executor."""
        return bool(self.tree_packing or self.long_context_replay)

    @property
    def replay_block_size(self) -> int:
        return self.tree_block_size or DEFAULT_BLOCK_SIZE

    def validate_tree_options(self) -> None:
        """Check every field and the rules between them.

        Raises:
            ValueError: naming the option, the rule and the fix.
        """
        check_fields(self, TreeOptions)
        if not self.tree_enabled:
            changed = [
                n
                for n in changed_fields(self, TreeOptions)
                if n not in ("tree_packing", "long_context_replay")
            ]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} set but tree_packing=False and long_context_replay=False, so it would have "
                    "no effect: set tree_packing=True (or long_context_replay=True), or drop the setting"
                )
            return
        if self.long_context_replay and self.tree_mode in ("keep", "packed"):
            raise ValueError(
                f"long_context_replay=True runs prompts in replay mode, which contradicts tree_mode={self.tree_mode!r}: "
                "use tree_mode='auto' or 'replay', or set long_context_replay=False"
            )
        self._check_no_effect()
        if self.long_context_prompt_grad == "none" and not self.long_context_replay:
            raise ValueError(
                "long_context_prompt_grad='none' only applies with long_context_replay=True: set it, or keep "
                "long_context_prompt_grad='exact'"
            )

    def _check_no_effect(self) -> None:
        """Refuse a setting the chosen mode ignores (so a user never tunes a knob that does nothing)."""
        if self.tree_replay_threshold is not None and (self.tree_mode != "auto" or self.long_context_replay):
            which = (
                "long_context_replay=True" if self.long_context_replay else f"tree_mode={self.tree_mode!r}"
            )
            raise ValueError(
                f"tree_replay_threshold only applies with tree_mode='auto', and {which} fixes the mode: drop "
                "tree_replay_threshold, or use tree_mode='auto'"
            )
        if self.tree_block_size is not None and self.tree_mode == "packed":
            raise ValueError(
                "tree_block_size has no effect with tree_mode='packed' (one packed sequence per forest): drop it, or "
                "use tree_mode='replay' to bound activation memory by blocks"
            )

    @property
    def replay_threshold(self) -> int:
        """Tokens per path above which ``tree_mode='auto'`` picks replay."""
        return DEFAULT_REPLAY_THRESHOLD if self.tree_replay_threshold is None else self.tree_replay_threshold

    def tree_options(self) -> TreeOptions:
        """These options as a plain :class:`TreeOptions` (from a host config that inherits them)."""
        return TreeOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TreeOptions)})

    def mode_for(self, longest_path: int, gradient_checkpointing: bool = False) -> ExecMode:
        """The executor mode for a forest whose longest root-to-leaf path has ``longest_path`` tokens."""
        if self.long_context_replay:
            return "replay"
        if self.tree_mode != "auto":
            return self.tree_mode
        if gradient_checkpointing or longest_path > self.replay_threshold:
            return "replay"
        return "keep"

    def executor_kwargs(self, mode: ExecMode) -> dict:
        """``TreeExecutor`` keyword arguments for ``mode``."""
        replay = mode == "replay"
        return {
            "mode": mode,
            "block_size": self.replay_block_size if replay else self.tree_block_size,
            "prompt_grad": self.long_context_prompt_grad if replay else "exact",
        }


@dataclass
class GroupedRanksOptions:
    """The option of a host whose data-parallel ranks each hold their own rows and may be grouped to
    split long prompts between them (TRL: accelerate's processes). veRL and OpenRLHF split prompts
    over their own sequence-parallel groups instead (``ulysses_sequence_parallel_size``,
    ``--ds.ring_attn_size``), whose ranks hold the same rows.
    """

    long_context_cp_size: int = option(
        1,
        "With long_context_replay: split each long prompt's cache over groups of this many consecutive processes "
        "(context parallelism), which train the union of their rows together, so the longest prompt is a group's, "
        "not one device's, and the group computes its chunks at once. Must divide the number of processes. The "
        "update is the host's own (each process keeps its own loss and rows).",
    )

    def validate_grouped_ranks(self) -> None:
        """Raises ValueError naming ``long_context_cp_size``'s rule and the fix."""
        size = self.long_context_cp_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"long_context_cp_size={size!r} must be a positive integer (1: no splitting)")
        if size > 1 and not getattr(self, "long_context_replay", False):
            raise ValueError(
                f"long_context_cp_size={size} splits prompts in long-context replay: set long_context_replay=True, "
                "or drop long_context_cp_size"
            )
        if size > 1 and getattr(self, "tree_balance", "auto") == "on":
            raise ValueError(
                f"tree_balance='on' moves rows between processes, and long_context_cp_size={size} trains each "
                "group's rows together where they are: set tree_balance='auto' (off under context parallelism)"
            )
