"""forkrl's command line.

    python -m forkrl estimate --model <path or name> --dataset <jsonl/parquet/csv/folder/hub name> \
        --num-generations G --max-completion-length R [--host trl|verl|openrlhf]
    python -m forkrl estimate --model <path or name> --rollouts <logged rollouts file> [--host ...]

``estimate`` reports what tree training would save on the user's own prompts before they switch
it on (module :mod:`forkrl.core.estimate`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

#: Per host: its stock micro-batch in tokens is not known here, but these are its defaults that
#: change the estimate: no-grad scoring passes per step (veRL and OpenRLHF score the old and the
#: reference log-probs; TRL's defaults, beta=0 and one iteration, score neither) and gradient
#: checkpointing (on by default in TRL's and veRL's configs, off in OpenRLHF's); and the columns a
#: prompt is looked for in, by the host's dataset convention (OpenRLHF's ``--data.input_key``
#: defaults to ``input``; TRL's and veRL's datasets carry ``prompt``).
HOST_DEFAULTS = {
    "trl": {"score_passes": 0, "gradient_checkpointing": True, "prompt_keys": ("prompt",)},
    "verl": {"score_passes": 2, "gradient_checkpointing": True, "prompt_keys": ("prompt",)},
    "openrlhf": {"score_passes": 2, "gradient_checkpointing": False, "prompt_keys": ("input", "prompt")},
}
#: Models up to this many parameters are timed on this machine under ``--price auto``.
FIT_MAX_PARAMS = 60_000_000
#: Timed samples per calibration batch and path under ``--price fit`` (their spread is reported).
DEFAULT_REPEATS = 3
PROG = "python -m forkrl estimate"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m forkrl", description="forkrl's tools")
    sub = ap.add_subparsers(dest="command", required=True)
    est = sub.add_parser(
        "estimate",
        help="predict what tree training saves on your prompts",
        description="Predict the forest's compression, each tree mode's step speedup and memory, and the mode "
        "tree_mode=auto picks, from your prompts (or logged rollouts) and your model.",
    )
    est.add_argument(
        "--model", required=True, help="model folder or hub name (its config; weights are not read)"
    )
    source = est.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--dataset",
        help="prompts: .jsonl/.json/.parquet/.csv, a saved dataset folder, or a hub name "
        "(each prompt gets G synthetic completions of R tokens)",
    )
    source.add_argument(
        "--rollouts",
        help="logged rollouts instead of prompts (.jsonl etc.: a prompt and a completion per row; "
        "rows with the same prompt form a group)",
    )
    est.add_argument(
        "--num-generations",
        "-G",
        type=int,
        metavar="G",
        help="completions per prompt (required with --dataset; with --rollouts, checked against the logged groups)",
    )
    est.add_argument(
        "--max-completion-length",
        "-R",
        type=int,
        metavar="R",
        help="completion tokens (required with --dataset: each synthetic completion has R; with --rollouts, "
        "checked against the logged completions)",
    )
    est.add_argument(
        "--host",
        choices=sorted(HOST_DEFAULTS),
        default="trl",
        help="the host's dataset keys and defaults (default: trl)",
    )
    est.add_argument("--tokenizer", help="tokenizer folder or name (default: the model's)")
    est.add_argument(
        "--prompt-key", help="the prompt column (default: the host's: prompt, or input for openrlhf)"
    )
    est.add_argument("--split", default="train", help="dataset split (folders and hub datasets)")
    est.add_argument(
        "--limit",
        type=int,
        default=0,
        metavar="N",
        help="the first N prompts only (with --rollouts: the first N logged groups; 0: all)",
    )
    est.add_argument(
        "--prompts-per-step",
        type=int,
        default=8,
        metavar="N",
        help="prompts per optimizer step (one forest each; default 8)",
    )
    est.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=16384,
        metavar="N",
        help="stock micro-batch bound in padded tokens (default 16384)",
    )
    est.add_argument(
        "--price",
        choices=("auto", "fit", "config"),
        default="auto",
        help=f"fit: time the model here; config: FLOPs; auto: fit up to {FIT_MAX_PARAMS // 10**6}M parameters",
    )
    est.add_argument(
        "--repeats",
        type=int,
        metavar="N",
        help=f"timed samples per calibration batch when the model is timed (default {DEFAULT_REPEATS}, at "
        "least 2): each batch's fastest is fitted, so more make the estimate steadier",
    )
    est.add_argument(
        "--timing-threads",
        type=int,
        metavar="N",
        help="torch threads while the model is timed (default 1: other processes' load then slows every path "
        "alike; 0: torch's own setting, for a machine nothing else uses)",
    )
    est.add_argument(
        "--score-passes", type=int, metavar="K", help="no-grad scoring passes per step (default: the host's)"
    )
    gc = est.add_mutually_exclusive_group()
    gc.add_argument(
        "--gradient-checkpointing", dest="gradient_checkpointing", action="store_true", default=None
    )
    gc.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false")
    est.add_argument("--json", action="store_true", help="print only the estimate as JSON")
    return ap


def _say(args, message: str) -> None:
    if not args.json:
        print(message, file=sys.stderr, flush=True)


def _fail(message: str) -> SystemExit:
    return SystemExit(f"{PROG}: error: {message}")


def _check_args(args) -> None:
    """Refuse what the arguments alone get wrong, before any file, config or model is read."""
    from forkrl.core.estimate.workload import check_source

    if args.dataset is not None:
        for flag, value in (
            ("--num-generations", args.num_generations),
            ("--max-completion-length", args.max_completion_length),
        ):
            if value is None:
                raise _fail(
                    f"{flag} is required with --dataset (synthetic completions need it); or give --rollouts"
                )
    for flag, value, least in (
        ("--num-generations", args.num_generations, 1),
        ("--max-completion-length", args.max_completion_length, 1),
        ("--prompts-per-step", args.prompts_per_step, 1),
        ("--micro-batch-tokens", args.micro_batch_tokens, 1),
        ("--limit", args.limit, 0),
        ("--score-passes", args.score_passes, 0),
        ("--repeats", args.repeats, 2),
        ("--timing-threads", args.timing_threads, 0),
    ):
        if value is not None and value < least:
            raise _fail(f"{flag} must be >= {least}, got {value}")
    for flag, value in (("--repeats", args.repeats), ("--timing-threads", args.timing_threads)):
        if value is not None and args.price == "config":
            raise _fail(f"{flag} sets how the model is timed, and --price config does not time it: drop one")
    try:
        if args.dataset is not None:
            check_source(args.dataset, "--dataset")
        else:
            check_source(args.rollouts, "--rollouts")
    except ValueError as err:
        raise _fail(str(err)) from None


def _load_model_parts(args):
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as err:
        raise _fail(f"--model {args.model}: no config found ({err})") from None
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    except (OSError, ValueError, TypeError):
        if args.tokenizer:
            raise _fail(f"--tokenizer {args.tokenizer}: not found") from None
    return config, tokenizer


def parameter_count(n: int) -> str:
    """``n`` parameters in a unit that keeps three significant figures: 812, 180K, 1.23M, 7B."""
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _fit(args, config, workload, options, params: int):
    import torch
    from transformers import AutoModelForCausalLM

    from forkrl.core.estimate import fit_pricing
    from forkrl.core.estimate.pricing import calibration_steps
    from forkrl.core.estimate.workload import dense_stats

    repeats = args.repeats or DEFAULT_REPEATS
    # 0 asks for torch's own thread count, which fit_pricing keeps when given None.
    threads = 1 if args.timing_threads is None else args.timing_threads or None
    _say(
        args,
        f"timing the model here ({parameter_count(params)} parameters, random weights, {repeats} repeats)",
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # The median step by the stock path's tokens is the one the batches are cut from.
    by_size = sorted(workload.steps, key=lambda st: dense_stats(st, args.micro_batch_tokens)[0].tokens)
    steps = calibration_steps(by_size[len(by_size) // 2])
    return fit_pricing(
        model,
        steps,
        args.micro_batch_tokens,
        options.replay_block_size,
        1 << 13,
        gradient_checkpointing=args.gradient_checkpointing,
        repeats=repeats,
        threads=threads,
        score=args.score_passes > 0,
        progress=lambda m: _say(args, m),
    )


def _config(args, config, workload, options, params: int):
    from forkrl.core.estimate import config_pricing

    unused = (
        " (nothing is timed: --repeats and --timing-threads unused)"
        if args.repeats is not None or args.timing_threads is not None
        else ""
    )
    _say(args, f"pricing from the config ({parameter_count(params)} parameters){unused}")
    return config_pricing(config)


#: ``--price`` sources: each returns a :class:`~forkrl.core.estimate.Pricing` for the workload.
PRICING_SOURCES: dict[str, Callable] = {"fit": _fit, "config": _config}


def _pricing(args, config, workload, options):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    source = args.price
    if source == "auto":
        source = "fit" if params <= FIT_MAX_PARAMS else "config"
    return PRICING_SOURCES[source](args, config, workload, options, params)


def _workload(args, config, tokenizer):
    from forkrl.core.estimate import load_rows, read_workload

    keys = (args.prompt_key,) if args.prompt_key else HOST_DEFAULTS[args.host]["prompt_keys"]
    logged = args.rollouts is not None
    try:
        rows = load_rows(
            args.rollouts if logged else args.dataset, args.split, "--rollouts" if logged else "--dataset"
        )
        return read_workload(
            None if logged else rows,
            args.num_generations,
            args.max_completion_length,
            args.prompts_per_step,
            tokenizer,
            keys,
            rows if logged else None,
            vocab_size=getattr(config, "vocab_size", None) or 32000,
            limit=args.limit,
        )
    except ValueError as err:
        raise _fail(str(err)) from None


def estimate_main(args) -> int:
    """``python -m forkrl estimate`` on parsed arguments: prints the report (or its JSON)."""
    from forkrl.core.estimate import estimate, format_report
    from forkrl.core.train import TreeOptions

    start = time.perf_counter()
    _check_args(args)
    defaults = HOST_DEFAULTS[args.host]
    if args.score_passes is None:
        args.score_passes = defaults["score_passes"]
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = defaults["gradient_checkpointing"]
    config, tokenizer = _load_model_parts(args)
    workload = _workload(args, config, tokenizer)
    options = TreeOptions(tree_packing=True)
    pricing = _pricing(args, config, workload, options)
    est = estimate(
        workload,
        pricing,
        config,
        args.micro_batch_tokens,
        args.score_passes,
        args.gradient_checkpointing,
        options,
    )
    if args.json:
        print(json.dumps(est.as_dict()))
    else:
        print(format_report(est))
        print(f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "estimate":
        return estimate_main(args)
    return 2  # pragma: no cover - argparse requires a command


if __name__ == "__main__":
    sys.exit(main())
