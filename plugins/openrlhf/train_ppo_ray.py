"""OpenRLHF's ``train_ppo_ray`` with forkrl: the same command, forkrl's flags added.

    python -m forkrl.plugins.openrlhf.train_ppo_ray <OpenRLHF's flags> --forkrl.tree_packing \\
        [--forkrl.tree_mode auto|keep|replay|packed] [--forkrl.long_context_replay] ...

forkrl's ``--forkrl.*`` flags are taken off the command line and checked (an unknown flag, a bad
value, contradictory options, an OpenRLHF setting the tree cannot make exact or a model flag naming
a local path that does not exist is an error here, before Ray starts); the rest is OpenRLHF's,
parsed and validated by OpenRLHF's own ``__main__``, run unchanged with ``runpy``. Three
module-level names are swapped while it runs (listed in :data:`forkrl.plugins.openrlhf.compat.SWAPS`):
the policy and reference actor classes (forkrl's, in :mod:`forkrl.plugins.openrlhf.actors`, so
every Ray worker builds them), and ``hierarchize``, whose result gets forkrl's options as
``args.forkrl`` (they reach every actor through ``strategy.args``).

``--help`` prints forkrl's flags, then OpenRLHF's.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from . import compat
from .options import PROG, ForkrlOptions, attach, check_host_args, check_model_paths, flag_parser, parse_flags

__all__ = ["HOST_MODULE", "main", "parse_args", "run_host"]

HOST_MODULE = "openrlhf.cli.train_ppo_ray"


class _Parsed(Exception):  # noqa: N818 (a control-flow signal, not an error)
    def __init__(self, args: Any) -> None:
        super().__init__("parsed")
        self.parsed = args


def _hierarchize_with(options: ForkrlOptions):
    from openrlhf.utils import config

    host = config.hierarchize

    def hierarchize(args):
        args = attach(host(args), options)
        try:
            check_model_paths(args)
            check_host_args(args, options)
        except ValueError as err:
            raise SystemExit(f"{PROG}: error: {err}") from None
        return args

    return hierarchize


def run_host(argv: Sequence[str]) -> None:
    """Run OpenRLHF's own ``train_ppo_ray`` as ``__main__`` with the command line ``argv``, as is."""
    saved = sys.argv
    sys.argv = [HOST_MODULE.replace(".", "/") + ".py", *argv]
    sys.modules.pop(HOST_MODULE, None)  # imported as a module (e.g. by compat.check): run a fresh __main__
    try:
        runpy.run_module(HOST_MODULE, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved


def parse_args(argv: Sequence[str]) -> Any:
    """OpenRLHF's final ``args`` for a command line (forkrl's flags included, as ``args.forkrl``),
    parsed and validated by OpenRLHF's own ``__main__`` exactly as a run would, without starting
    Ray or any model (a dry run: it stops where ``train(args)`` would build the strategy).

    Raises:
        SystemExit: for a command line OpenRLHF or forkrl refuses.
    """
    import openrlhf.utils
    import ray

    options, rest = parse_flags(argv)

    def stop(args):
        raise _Parsed(args)

    try:
        with (
            compat.swapped("openrlhf.utils.config", hierarchize=_hierarchize_with(options)),
            compat.swapped(openrlhf.utils, get_strategy=stop),
            compat.swapped(ray, is_initialized=lambda: True),
        ):
            run_host(rest)
    except _Parsed as parsed:
        return parsed.parsed
    raise RuntimeError(f"{HOST_MODULE} finished without reaching train(args)")


def main(argv: Sequence[str] | None = None) -> None:
    """Run OpenRLHF's PPO/GRPO training with forkrl's actors and options."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(flag_parser().format_help())
        print("OpenRLHF's flags (python -m openrlhf.cli.train_ppo_ray --help):\n")
        run_host(["--help"])
        return
    options, rest = parse_flags(argv)
    from . import actors

    with contextlib.ExitStack() as stack:
        stack.enter_context(compat.swapped("openrlhf.utils.config", hierarchize=_hierarchize_with(options)))
        stack.enter_context(
            compat.swapped("openrlhf.trainer.ray.ppo_actor", PolicyModelActor=actors.PolicyModelActor)
        )
        stack.enter_context(
            compat.swapped("openrlhf.trainer.ray.launcher", ReferenceModelActor=actors.ReferenceModelActor)
        )
        if options.speculative_rollout:
            from openrlhf.trainer import ppo_trainer, ppo_trainer_async
            from openrlhf.trainer.ray import vllm_engine

            from .rollout import SpeculativeRolloutActor, speculative_trainer

            engine = SpeculativeRolloutActor(vllm_engine.RolloutRayActor, options)
            stack.enter_context(compat.swapped(vllm_engine, RolloutRayActor=engine))
            stack.enter_context(
                compat.swapped(ppo_trainer, PPOTrainer=speculative_trainer(ppo_trainer.PPOTrainer))
            )
            stack.enter_context(
                compat.swapped(
                    ppo_trainer_async, TrainingActor=speculative_trainer(ppo_trainer_async.TrainingActor)
                )
            )
        run_host(rest)


if __name__ == "__main__":
    main()
