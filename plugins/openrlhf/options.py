"""forkrl's OpenRLHF flags (``--forkrl.<option>``, OpenRLHF's dotted style) and the setups they refuse.

The flags are the fields of :class:`forkrl.core.train.TreeOptions` and
:class:`forkrl.core.speculative.SpeculativeOptions` (one definition for every host). The
launcher parses them off the command line before OpenRLHF sees it (:func:`parse_flags`) and
attaches them to OpenRLHF's arguments as ``args.forkrl`` (a namespace, like OpenRLHF's own
``args.actor``), which reach every Ray actor through ``strategy.args``; :func:`options_from`
reads them back there.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from forkrl.core.balance.rules import IMAGES, ROUTER_LOSS, BalanceOption, shared_by
from forkrl.core.options import add_arguments
from forkrl.core.speculative import SpeculativeOptions
from forkrl.core.train import TreeOptions
from forkrl.plugins.vllm import check_installs
from forkrl.plugins.vllm.speculative import check_engine_policy

from ..models import missing_model, no_such_model

__all__ = [
    "BALANCE",
    "FLAGS",
    "FLAG_OVERRIDES",
    "FLAG_PREFIX",
    "MODEL_FLAGS",
    "NOT_TAKEN",
    "PROG",
    "ForkrlOptions",
    "arg",
    "balance_setting",
    "check_host_args",
    "check_model_paths",
    "check_vlm_args",
    "flag_parser",
    "options_from",
    "parse_flags",
]

FLAG_PREFIX = "--forkrl."
#: ``--forkrl.tree_balance`` in OpenRLHF's words (core's rule of when rows may move).
BALANCE = BalanceOption(
    on="--forkrl.tree_balance on", auto="--forkrl.tree_balance auto", off="--forkrl.tree_balance off"
)
_RING = shared_by("a ring-attention group (--ds.ring_attn_size > 1)")
#: The launcher's name in its usage and error lines.
PROG = "python -m forkrl.plugins.openrlhf.train_ppo_ray"
#: Options core defines that OpenRLHF's launcher does not take, and why (the usage error says it).
#: ``speculative_margin`` is read only by the 'auto' speculation policy, which cannot run here (see
#: ``speculative_policy`` below): vLLM's draft length is fixed when OpenRLHF builds its engines.
NOT_TAKEN: dict[str, str] = {
    "speculative_margin": "it is read only by the 'auto' speculation policy, which OpenRLHF's launcher cannot run "
    "(forkrl would have to time the policy model before vLLM starts, and OpenRLHF starts its engines before any "
    "policy model exists); drop it: speculation here is 'always', its draft length --forkrl.speculative_draft_len",
}
#: The options OpenRLHF takes: all of core's but :data:`NOT_TAKEN`.
FLAGS: tuple[str, ...] = tuple(
    f.name
    for f in dataclasses.fields(TreeOptions) + dataclasses.fields(SpeculativeOptions)
    if f.name not in NOT_TAKEN
)
#: What OpenRLHF's launcher documents differently from core: one speculation policy.
FLAG_OVERRIDES: dict[str, dict[str, Any]] = {
    "speculative_policy": {
        "default": None,
        "choices": ("always",),
        "help": "'always' (the default with --forkrl.speculative_rollout): speculate every step with "
        "speculative_draft_len. forkrl's 'auto' policy times the policy model before vLLM starts, and OpenRLHF "
        "starts its engines before any policy model exists, so it cannot run here.",
    },
}


@dataclass
class ForkrlOptions(TreeOptions, SpeculativeOptions):
    """forkrl's OpenRLHF options: tree training and self-speculative rollouts (core's classes, combined)."""

    def __post_init__(self) -> None:
        self.validate_tree_options()
        self.validate_speculative_options()


def flag_parser() -> argparse.ArgumentParser:
    """The parser of forkrl's flags alone (its help is printed beside OpenRLHF's)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="OpenRLHF's train_ppo_ray with forkrl: every OpenRLHF flag, plus these.",
        add_help=False,
        allow_abbrev=False,
    )
    add_arguments(parser, ForkrlOptions, prefix=FLAG_PREFIX, only=FLAGS, overrides=FLAG_OVERRIDES)
    return parser


def parse_flags(argv: Sequence[str]) -> tuple[ForkrlOptions, list[str]]:
    """Split ``argv`` into forkrl's options and the rest (OpenRLHF's flags, untouched).

    Raises:
        SystemExit: (argparse's usage error) for an unknown ``--forkrl.*`` flag, a bad value, or
            contradictory options, naming the flag.
    """
    parser = flag_parser()
    namespace, rest = parser.parse_known_args(list(argv))
    unknown = [arg.split("=", 1)[0] for arg in rest if arg.startswith(FLAG_PREFIX)]
    for flag in unknown:
        name = flag[len(FLAG_PREFIX) :]
        if name in NOT_TAKEN:
            parser.error(f"{flag} is not taken by OpenRLHF's launcher: {NOT_TAKEN[name]}")
    if unknown:
        names = ", ".join(FLAG_PREFIX + name for name in FLAGS)
        parser.error(f"unknown forkrl flag {unknown[0]}: forkrl's flags are {names}")
    values = {name: getattr(namespace, FLAG_PREFIX[2:] + name) for name in FLAGS}
    if values["speculative_policy"] is None:  # not given: 'always' where it applies, core's default elsewhere
        values.pop("speculative_policy")
        if values["speculative_rollout"]:
            values["speculative_policy"] = "always"
    try:
        options = ForkrlOptions(**values)
    except ValueError as err:
        parser.error(f"forkrl flags: {err} (each option X is the flag {FLAG_PREFIX}X)")
    return options, rest


def attach(args: Any, options: ForkrlOptions) -> Any:
    """Put ``options`` on OpenRLHF's (hierarchized) ``args`` as ``args.forkrl``."""
    args.forkrl = SimpleNamespace(**dataclasses.asdict(options))
    return args


def options_from(args: Any) -> ForkrlOptions:
    """forkrl's options from OpenRLHF's ``args`` (``strategy.args``); all off when absent."""
    values = getattr(args, "forkrl", None)
    return ForkrlOptions(**vars(values)) if values is not None else ForkrlOptions()


def arg(args: Any, path: str, default: Any = None) -> Any:
    """OpenRLHF's nested argument at dotted ``path`` (``"vllm.num_engines"``), or ``default`` where
    any part is absent or None."""
    node = args
    for part in path.split("."):
        node = getattr(node, part, None)
        if node is None:
            return default
    return node


def _balance_unsafe(args: Any) -> str | None:
    """Why moving a window's rows between ranks would change OpenRLHF's update (None: it would not)."""
    if bool(arg(args, "train.dynamic_batch_enable", False)):
        return "--train.dynamic_batch_enable gives every rank its own window lengths"
    if float(arg(args, "actor.aux_loss_coef", 0.0) or 0.0) > 0:
        return f"{ROUTER_LOSS} (--actor.aux_loss_coef > 0)"
    return None


def _ring_group(args: Any) -> str | None:
    """Why a window's rows cannot move under ring attention (None: no ring group)."""
    return _RING if (arg(args, "ds.ring_attn_size", 1) or 1) > 1 else None


def _data_parallel(args: Any) -> int:
    """The actor's data-parallel ranks, as OpenRLHF's launcher places them."""
    gpus = int(arg(args, "actor.num_nodes", 1) or 1) * int(arg(args, "actor.num_gpus_per_node", 1) or 1)
    group = int(arg(args, "ds.ring_attn_size", 1) or 1) * int(arg(args, "ds.tensor_parallel_size", 1) or 1)
    return max(1, gpus // group)


def balance_setting(args: Any, options: ForkrlOptions, world: int, vlm: bool = False) -> bool:
    """Whether each optimizer step's rows are rebalanced over the ``world`` data-parallel ranks
    (never for a vision-language actor, whose rows would move without their images, nor under ring
    attention, whose group shares its micro-batches instead: trainer module)."""
    fixed = IMAGES if vlm else _ring_group(args)
    return BALANCE.balances(options.tree_balance, world, fixed=fixed, loss=_balance_unsafe(args))


def check_host_args(args: Any, options: ForkrlOptions) -> None:
    """Refuse OpenRLHF settings that tree training or the vLLM drafter cannot serve (before anything starts).

    Raises:
        ValueError: naming the OpenRLHF flag and the alternative.
    """
    if options.speculative_rollout:
        _check_speculative_args(args, options)
    if not options.tree_enabled:
        return
    flag = "--forkrl.tree_packing" if options.tree_packing else "--forkrl.long_context_replay"
    refusals = [
        (
            (arg(args, "ds.tensor_parallel_size", 1) or 1) > 1,
            "--ds.tensor_parallel_size > 1 (DeepSpeed AutoTP) shards layers across ranks: use --ds.tensor_parallel_size 1",
        ),
        (
            bool(arg(args, "train.dynamic_batch_enable", False)) and arg(args, "ds.zero_stage", 2) in (1, 2),
            "--train.dynamic_batch_enable with --ds.zero_stage 1/2: OpenRLHF then runs DeepSpeed with "
            "gradient_accumulation_steps=1 and steps once per window, and DeepSpeed 0.19's ZeRO-1/2 keeps only the "
            "last backward's gradient before a step, so stock OpenRLHF drops all but each step's last micro-batch "
            "and no tree step can equal that: use fixed micro-batches (drop --train.dynamic_batch_enable), "
            "--ds.zero_stage 3 or --ds.zero_stage 0",
        ),
        (
            arg(args, "ds.param_dtype", "bf16") == "fp16",
            "--ds.param_dtype fp16 needs DeepSpeed's loss scaling inside every backward, and the tree's backwards run "
            "outside DeepSpeed: use --ds.param_dtype bf16",
        ),
    ]
    counted = "--actor.num_nodes x --actor.num_gpus_per_node over ring and tensor parallelism"
    balance = BALANCE.refusal(
        options.tree_balance,
        _data_parallel(args),
        fixed=_ring_group(args),
        loss=_balance_unsafe(args),
        counted=counted,
    )
    refusals.append((balance is not None, balance or ""))
    for refused, why in refusals:
        if refused:
            raise ValueError(f"{flag}: {why}; or train without {flag}")


#: OpenRLHF's flags that name a model to load (a folder or a Hugging Face hub id; the reward's may
#: list several, comma-separated).
MODEL_FLAGS = ("actor.model_name_or_path", "critic.model_name_or_path", "reward.model_name_or_path")


def check_model_paths(args: Any) -> None:
    """Refuse a model flag whose value is a local path that does not exist (:func:`missing_model`),
    before Ray starts; a hub id is left to Hugging Face (it may be downloaded or cached).

    Raises:
        ValueError: naming the flag and the path.
    """
    for path in MODEL_FLAGS:
        value = arg(args, path)
        for name in str(value).split(",") if value else ():
            if missing_model(name.strip()):
                raise ValueError(no_such_model(f"--{path}", name.strip()))


def check_vlm_args(args: Any, options: ForkrlOptions) -> None:
    """Refuse OpenRLHF settings that a vision-language actor's tree training cannot serve.

    OpenRLHF itself trains such an actor unpacked (``train_ppo_ray`` refuses ``--ds.packing_samples``
    with images: packing breaks the rows' alignment with their pixels and the model's own M-RoPE
    positions), and the tree takes images in keep and replay modes only.

    Raises:
        ValueError: naming the flag and the alternative.
    """
    flag = "--forkrl.tree_packing" if options.tree_packing else "--forkrl.long_context_replay"
    refusals = [
        (
            (arg(args, "ds.ring_attn_size", 1) or 1) > 1,
            "a vision-language actor's images are not split over a ring-attention group (--ds.ring_attn_size > 1, "
            "which also packs samples): use --ds.ring_attn_size 1",
        ),
        (
            bool(arg(args, "train.dynamic_batch_enable", False)),
            "--train.dynamic_batch_enable packs samples, which OpenRLHF does not do for a vision-language actor: "
            "drop --train.dynamic_batch_enable",
        ),
        (
            bool(arg(args, "ds.packing_samples", False)),
            "OpenRLHF does not pack a vision-language actor's samples (packing breaks the rows' alignment with "
            "their pixel_values and the model's own positions): drop --ds.packing_samples",
        ),
        (
            options.tree_mode == "packed",
            "images run on a tree in keep or replay mode: use --forkrl.tree_mode auto, keep or replay",
        ),
        (options.tree_balance == "on", BALANCE.refusal(options.tree_balance, fixed=IMAGES)),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"{flag}: {why}; or train without {flag}")


def _check_speculative_args(args: Any, options: ForkrlOptions) -> None:
    if (arg(args, "vllm.num_engines", 0) or 0) < 1:
        raise ValueError(
            "--forkrl.speculative_rollout drafts inside OpenRLHF's vLLM engines: set --vllm.num_engines >= 1, or drop it"
        )
    check_engine_policy(
        options,
        calibrates=False,
        fix=" (as flags: --forkrl.speculative_policy always --forkrl.speculative_draft_len K)",
    )
    check_installs("drop --forkrl.speculative_rollout")
