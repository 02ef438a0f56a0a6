"""``trl vllm-serve`` with forkrl's self-drafter: the server half of ``speculative_rollout`` in server mode.

Usage (every ``trl vllm-serve`` / ``vllm serve`` flag is accepted and passed on)::

    python -m forkrl.plugins.trl.vllm_serve --model Qwen/Qwen2.5-0.5B \\
        --forkrl.speculative_draft_len 4 [--forkrl.speculative_bits 4] [--forkrl.speculative_group_size 128]

It adds ``--speculative_config`` (forkrl's quantized copy of the served model, for its
tensor-parallel size) to TRL's own server script, which then runs vLLM's server. forkrl must be
installed in the server's environment: vLLM loads forkrl's plugin from there, which registers the
drafter's quantization and re-syncs the drafter after each of the trainer's weight updates. The
trainer side is ``GRPOConfig(use_vllm=True, vllm_mode="server", speculative_rollout=True,
speculative_policy="always", ...)``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence

from forkrl.core.options import add_arguments
from forkrl.core.speculative import SpeculativeOptions
from forkrl.plugins.vllm import check_installs
from forkrl.plugins.vllm.speculative import vllm_speculative_config

__all__ = ["PROG", "flag_parser", "main", "server_command"]

PREFIX = "--forkrl."
_SERVER_FIELDS = ("speculative_bits", "speculative_group_size", "speculative_draft_len")


PROG = "python -m forkrl.plugins.trl.vllm_serve"


def flag_parser() -> argparse.ArgumentParser:
    """The parser of forkrl's server flags alone (its help is printed before TRL's)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="TRL's vllm-serve with forkrl's quantized self-drafter: every trl vllm-serve flag, plus these "
        "(the server speculates with speculative_policy='always').",
        add_help=False,
        allow_abbrev=False,
    )
    add_arguments(parser, SpeculativeOptions, prefix=PREFIX, only=_SERVER_FIELDS)
    return parser


def _parse(argv: Sequence[str]) -> tuple[SpeculativeOptions, list[str]]:
    parser = flag_parser()
    namespace, rest = parser.parse_known_args(list(argv))
    values = {f: getattr(namespace, PREFIX[2:] + f) for f in _SERVER_FIELDS}
    bad = [a.split("=", 1)[0] for a in rest if a.startswith(PREFIX)]
    if bad:
        parser.error(
            f"unknown forkrl flag {bad[0]}: the server takes {', '.join(PREFIX + f for f in _SERVER_FIELDS)}"
        )
    if any(a == "--speculative_config" or a.startswith("--speculative_config=") for a in rest):
        parser.error(
            "--speculative_config is forkrl's to set here: drop it (or run `trl vllm-serve` directly)"
        )
    try:
        options = SpeculativeOptions(speculative_rollout=True, speculative_policy="always", **values)
    except ValueError as err:
        parser.error(f"forkrl flags: {err}")
    return options, rest


def server_command(argv: Sequence[str]) -> tuple[object, list[str]]:
    """TRL's server arguments with forkrl's ``speculative_config`` set, and the flags passed on to vLLM.

    Raises:
        SystemExit: a usage error: a bad forkrl flag, or a vLLM forkrl's vLLM plugin does not install in.
    """
    from trl.scripts.vllm_serve import make_parser

    options, rest = _parse(argv)
    script_args, extra = make_parser(prog=PROG).parse_args_and_config(
        args=rest, return_remaining_strings=True
    )
    try:
        check_installs("drop forkrl's flags and run `trl vllm-serve` directly")
    except ValueError as err:  # a usage error, as the flags' own
        raise SystemExit(f"{PROG}: error: {err}") from None
    spec = vllm_speculative_config(options, script_args.model, script_args.tensor_parallel_size)
    script_args.speculative_config = json.dumps(spec)
    return script_args, list(extra)


def main(argv: Sequence[str] | None = None) -> None:
    """Start TRL's vLLM server with forkrl's drafter (this process becomes the server)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from trl.scripts.vllm_serve import make_parser

        print(flag_parser().format_help())
        print("TRL's vllm-serve flags (trl vllm-serve --help):\n")
        make_parser(prog=PROG).print_help()
        return
    script_args, extra = server_command(argv)
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(
            f"{PROG}: error: vLLM is not installed in this environment ({sys.executable}): the server runs vLLM. "
            "Install it beside forkrl on the GPU machine that serves (pip install -e '.[vllm]', vllm 0.29.0)"
        )
    from trl.scripts.vllm_serve import main as trl_main

    trl_main(script_args, extra)


if __name__ == "__main__":
    main()
