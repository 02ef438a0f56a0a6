"""forkrl's configs for TRL: TRL's GRPO/RLOO configs plus forkrl's options.

The subclasses only add fields (precedent: TRL's ``experimental/gmpo``): the fields and their rules
are core's :class:`~forkrl.core.train.TreeOptions` and
:class:`~forkrl.core.speculative.SpeculativeOptions`, inherited as they are; every TRL field keeps
its meaning and default. What is checked here is what only TRL's own settings can contradict
(fp16 scaling, engines, the vLLM drafter's fixed draft length, sampling options the exact sampler
cannot reproduce).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from trl import GRPOConfig as _TRLGRPOConfig
from trl import RLOOConfig as _TRLRLOOConfig

from forkrl.core.speculative import SpeculativeOptions
from forkrl.core.train import GroupedRanksOptions, TreeOptions
from forkrl.plugins.vllm import check_installs
from forkrl.plugins.vllm.speculative import check_engine_policy

__all__ = ["FORKRL_FIELDS", "ForkrlOptions", "GRPOConfig", "RLOOConfig"]


@dataclass
class ForkrlOptions(TreeOptions, GroupedRanksOptions, SpeculativeOptions):
    """forkrl's fields, shared by the GRPO and RLOO configs (core's option classes, combined)."""

    def __post_init__(self) -> None:  # the host config's own __post_init__ validates
        pass

    def validate_forkrl(self) -> None:
        """Core's rules, then the ones TRL's own settings decide.

        Raises:
            ValueError: naming the option, the rule and the fix.
        """
        self.validate_tree_options()
        self.validate_grouped_ranks()
        self.validate_speculative_options()
        if self.tree_enabled:
            self._validate_tree_host()
        if self.speculative_rollout:
            self._validate_speculative_host()

    def _validate_tree_host(self) -> None:
        if getattr(self, "neftune_noise_alpha", None) is not None:
            raise ValueError(
                f"tree_packing/long_context_replay cannot reproduce NEFTune (neftune_noise_alpha={self.neftune_noise_alpha}): "
                "its noise is drawn per token of each sequence and scaled by each forward's padded length, while a tree "
                "embeds a shared prefix once for all its sequences, so the noise and its distribution would differ; "
                "set neftune_noise_alpha=None or turn tree training off"
            )
        if self.fp16:
            raise ValueError(
                "tree_packing/long_context_replay do not support fp16 loss scaling (fp16=True): use bf16=True, or turn "
                "tree training off"
            )
        if self.fsdp and (self.fsdp_config or {}).get("version", 1) != 2:
            raise ValueError(
                "tree_packing/long_context_replay support FSDP2 only: set fsdp_config={'version': 2, ...} (FSDP1 wraps "
                "the model in a way the tree step cannot gather once per step), or turn tree training off"
            )

    def _validate_speculative_host(self) -> None:
        if getattr(self, "use_vllm", False):
            # vLLM drafts with forkrl's quantized policy; its draft lengths are fixed when the engine starts,
            # from forkrl's cost model only where the trainer builds the engine (colocate).
            check_engine_policy(
                self,
                calibrates=self.vllm_mode == "colocate",
                fix=" (in server mode the server fixes it: python -m forkrl.plugins.trl.vllm_serve)",
            )
            if self.vllm_mode == "colocate":  # the engine starts in this process (the server checks its own)
                check_installs(
                    "set speculative_rollout=False, or use_vllm=False (forkrl's sampler drafts in transformers)"
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
    def from_trl(cls, args: Any, **forkrl_fields: Any) -> ForkrlOptions:
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
            for name, default in _DEFAULTS.items():
                setattr(new, name, default)
        for name, value in forkrl_fields.items():
            setattr(new, name, value)
        new.validate_forkrl()
        return new


@dataclass
class GRPOConfig(ForkrlOptions, _TRLGRPOConfig):
    """TRL's :class:`trl.GRPOConfig` with forkrl's options (:class:`ForkrlOptions`)."""

    def __post_init__(self) -> None:
        _TRLGRPOConfig.__post_init__(self)
        self.validate_forkrl()


@dataclass
class RLOOConfig(ForkrlOptions, _TRLRLOOConfig):
    """TRL's :class:`trl.RLOOConfig` with forkrl's options (:class:`ForkrlOptions`)."""

    def __post_init__(self) -> None:
        _TRLRLOOConfig.__post_init__(self)
        self.validate_forkrl()


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ForkrlOptions)}
FORKRL_FIELDS = tuple(_DEFAULTS)
