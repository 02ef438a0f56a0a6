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
import json
import sys
from collections.abc import Sequence

from forkrl.core.options import add_arguments
from forkrl.core.speculative import SpeculativeOptions
from forkrl.core.speculative.vllm_engine import vllm_speculative_config

__all__ = ["main", "server_command"]

PREFIX = "--forkrl."
_SERVER_FIELDS = ("speculative_bits", "speculative_group_size", "speculative_draft_len")


def _parse(argv: Sequence[str]) -> tuple[SpeculativeOptions, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m forkrl.plugins.trl.vllm_serve", add_help=False, allow_abbrev=False
    )
    add_arguments(parser, SpeculativeOptions, prefix=PREFIX)
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
    """TRL's server arguments with forkrl's ``speculative_config`` set, and the flags passed on to vLLM."""
    from trl.scripts.vllm_serve import make_parser

    options, rest = _parse(argv)
    script_args, extra = make_parser(prog="python -m forkrl.plugins.trl.vllm_serve").parse_args_and_config(
        args=rest, return_remaining_strings=True
    )
    spec = vllm_speculative_config(options, script_args.model, script_args.tensor_parallel_size)
    script_args.speculative_config = json.dumps(spec)
    return script_args, list(extra)


def main(argv: Sequence[str] | None = None) -> None:
    """Start TRL's vLLM server with forkrl's drafter (this process becomes the server)."""
    from trl.scripts.vllm_serve import main as trl_main

    script_args, extra = server_command(sys.argv[1:] if argv is None else argv)
    trl_main(script_args, extra)


if __name__ == "__main__":
    main()
