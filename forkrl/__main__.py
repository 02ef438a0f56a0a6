"""forkrl's command line.

    python -m forkrl estimate --model <path or name> --dataset <jsonl/parquet/csv/folder/hub name> \
        --num-generations G --max-completion-length R [--host trl|verl|openrlhf] [--rollouts FILE]

``estimate`` reports what tree training would save on the user's own prompts before they switch
it on (module :mod:`forkrl.core.estimate`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

#: Per host: its stock micro-batch in tokens is not known here, but these are its defaults that
#: change the estimate: no-grad scoring passes per step (veRL and OpenRLHF score the old and the
#: reference log-probs; TRL's defaults, beta=0 and one iteration, score neither) and gradient
#: checkpointing (on by default in TRL's and veRL's configs, off in OpenRLHF's).
HOST_DEFAULTS = {
    "trl": {"score_passes": 0, "gradient_checkpointing": True},
    "verl": {"score_passes": 2, "gradient_checkpointing": True},
    "openrlhf": {"score_passes": 2, "gradient_checkpointing": False},
}
#: Models up to this many parameters are timed on this machine under ``--price auto``.
FIT_MAX_PARAMS = 60_000_000


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
    est.add_argument(
        "--dataset",
        required=True,
        help="prompts: .jsonl/.json/.parquet/.csv, a saved dataset folder, or a hub name",
    )
    est.add_argument(
        "--num-generations", "-G", type=int, required=True, metavar="G", help="completions per prompt"
    )
    est.add_argument(
        "--max-completion-length",
        "-R",
        type=int,
        required=True,
        metavar="R",
        help="completion tokens (each synthetic completion has R)",
    )
    est.add_argument(
        "--host",
        choices=sorted(HOST_DEFAULTS),
        default="trl",
        help="the host's dataset keys and defaults (default: trl)",
    )
    est.add_argument(
        "--rollouts",
        help="logged rollouts (.jsonl etc.: a prompt and a completion per row) instead of synthetic completions",
    )
    est.add_argument("--tokenizer", help="tokenizer folder or name (default: the model's)")
    est.add_argument(
        "--prompt-key", help="the prompt column (default: the host's: prompt, or input for openrlhf)"
    )
    est.add_argument("--split", default="train", help="dataset split (folders and hub datasets)")
    est.add_argument(
        "--limit", type=int, default=0, metavar="N", help="read the first N prompts only (0: all)"
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


def _load_model_parts(args):
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as err:
        raise SystemExit(
            f"python -m forkrl estimate: error: --model {args.model}: no config found ({err})"
        ) from None
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    except (OSError, ValueError, TypeError):
        if args.tokenizer:
            raise SystemExit(
                f"python -m forkrl estimate: error: --tokenizer {args.tokenizer}: not found"
            ) from None
    return config, tokenizer


def _pricing(args, config, workload, options):
    import torch
    from transformers import AutoModelForCausalLM

    from forkrl.core.estimate import config_pricing, fit_pricing
    from forkrl.core.estimate.pricing import calibration_shapes

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if args.price == "config" or (args.price == "auto" and params > FIT_MAX_PARAMS):
        _say(args, f"pricing from the config ({params / 1e6:.0f}M parameters)")
        return config_pricing(config)
    _say(args, f"timing the model here ({params / 1e6:.1f}M parameters, random weights)")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shapes = calibration_shapes(
        int(statistics.median(workload.prompt_lengths())),
        args.num_generations,
        int(statistics.median(workload.completion_lengths())),
    )
    return fit_pricing(
        model,
        shapes,
        args.micro_batch_tokens,
        options.replay_block_size,
        1 << 13,
        gradient_checkpointing=args.gradient_checkpointing,
        progress=lambda m: _say(args, m),
    )


def estimate_main(args) -> int:
    from forkrl.core.estimate import estimate, format_report, load_rows, read_workload
    from forkrl.core.estimate.workload import PROMPT_KEYS
    from forkrl.core.train import TreeOptions

    start = time.perf_counter()
    defaults = HOST_DEFAULTS[args.host]
    if args.score_passes is None:
        args.score_passes = defaults["score_passes"]
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = defaults["gradient_checkpointing"]
    config, tokenizer = _load_model_parts(args)
    keys = (args.prompt_key,) if args.prompt_key else PROMPT_KEYS[args.host]
    try:
        rows = load_rows(args.dataset, args.split)
        rows = rows[: args.limit] if args.limit else rows
        rollouts = load_rows(args.rollouts, args.split) if args.rollouts else None
        workload = read_workload(
            rows,
            args.num_generations,
            args.max_completion_length,
            args.prompts_per_step,
            tokenizer,
            keys,
            rollouts,
            vocab_size=config.vocab_size if hasattr(config, "vocab_size") else 32000,
        )
    except ValueError as err:
        raise SystemExit(f"python -m forkrl estimate: error: {err}") from None
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
