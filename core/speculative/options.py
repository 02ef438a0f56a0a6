"""Self-speculative rollout options: the one definition every host's flags derive from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from ..options import changed_fields, check_fields, option
from ..quant import DEFAULT_GROUP_SIZE, Bits, Int4GroupSize

__all__ = [
    "DEFAULT_DRAFT_LEN",
    "DEFAULT_MARGIN",
    "SPECULATIVE_POLICIES",
    "SpeculativeOptions",
    "SpeculativePolicyName",
]

SpeculativePolicyName = Literal["auto", "always"]
SPECULATIVE_POLICIES: tuple[str, ...] = get_args(SpeculativePolicyName)
#: Draft length of the 'always' policy when ``speculative_draft_len`` is not set.
DEFAULT_DRAFT_LEN = 4
#: The 'auto' policy's margin when ``speculative_margin`` is not set.
DEFAULT_MARGIN = 0.1


@dataclass
class SpeculativeOptions:
    """How rollouts speculate with a quantized copy of the policy.

    Use directly (validated on construction) or as a mixin of a host config that calls
    :meth:`validate_speculative_options` from its own ``__post_init__``.
    """

    speculative_rollout: bool = option(
        False,
        "Self-speculative rollouts: completions are drafted by a weight-quantized copy of the policy, re-derived "
        "after every optimizer step, and verified by the policy with exact rejection sampling, so they are "
        "distributed exactly as plain sampling (greedy: token-identical).",
    )
    speculative_bits: Bits = option(
        4, "Drafter weight bits: 4 (groupwise round-to-nearest) or 8 (per channel)."
    )
    speculative_group_size: Int4GroupSize | None = option(
        None,
        f"Drafter int4 group size (default {DEFAULT_GROUP_SIZE}; it must divide every quantized layer's inputs). "
        "int8 is per channel and takes none.",
    )
    speculative_policy: SpeculativePolicyName = option(
        "auto",
        "'auto': time the policy and the drafter on this machine at the first rollout and speculate only where the "
        "cost model predicts a gain, with the draft length following the acceptance rate (a vLLM engine built by the "
        "trainer gets the cost model's draft length per batch size, fixed when it starts). 'always': speculate every "
        "step with speculative_draft_len.",
    )
    speculative_draft_len: int | None = option(
        None,
        f"Draft length for speculative_policy='always' (default {DEFAULT_DRAFT_LEN}); an error with 'auto', which "
        "follows the acceptance rate.",
    )
    speculative_margin: float | None = option(
        None,
        "speculative_policy='auto' speculates only when the predicted speedup exceeds 1 + speculative_margin "
        f"(default {DEFAULT_MARGIN}); an error with 'always'.",
    )

    _minimums: ClassVar[dict[str, float]] = {"speculative_draft_len": 1, "speculative_margin": 0.0}

    def __post_init__(self) -> None:
        self.validate_speculative_options()

    def validate_speculative_options(self) -> None:
        """Check every field and the rules between them.

        Raises:
            ValueError: naming the option, the rule and the fix.
        """
        check_fields(self, SpeculativeOptions)
        changed = [n for n in changed_fields(self, SpeculativeOptions) if n != "speculative_rollout"]
        if not self.speculative_rollout:
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} set but speculative_rollout=False, so it would have no effect: set "
                    "speculative_rollout=True, or drop the setting"
                )
            return
        if self.speculative_bits == 8 and self.speculative_group_size is not None:
            raise ValueError(
                f"speculative_group_size={self.speculative_group_size} with speculative_bits=8: int8 drafters are per "
                "channel (torch's int8 kernel takes one scale per row); drop the group size or use speculative_bits=4"
            )
        if self.speculative_policy == "auto" and "speculative_draft_len" in changed:
            raise ValueError(
                "speculative_draft_len only applies with speculative_policy='always' ('auto' picks the draft length "
                "from the acceptance rate): set speculative_policy='always', or drop speculative_draft_len"
            )
        if self.speculative_policy == "always" and "speculative_margin" in changed:
            raise ValueError(
                "speculative_margin only applies with speculative_policy='auto': drop it, or use the 'auto' policy"
            )

    def speculative_options(self) -> SpeculativeOptions:
        """These options as a plain :class:`SpeculativeOptions` (from a host config that inherits them)."""
        return SpeculativeOptions(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(SpeculativeOptions)}
        )

    @property
    def draft_len(self) -> int:
        """The 'always' policy's draft length (``speculative_draft_len``, or its default)."""
        return DEFAULT_DRAFT_LEN if self.speculative_draft_len is None else self.speculative_draft_len

    @property
    def margin(self) -> float:
        """The 'auto' policy's margin (``speculative_margin``, or its default)."""
        return DEFAULT_MARGIN if self.speculative_margin is None else self.speculative_margin

    @property
    def drafter_group_size(self) -> int | None:
        """The int4 group size the drafter uses (None for int8)."""
        return (self.speculative_group_size or DEFAULT_GROUP_SIZE) if self.speculative_bits == 4 else None
