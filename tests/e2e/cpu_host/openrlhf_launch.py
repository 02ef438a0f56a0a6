"""Test-only: run an OpenRLHF launcher module as ``python -m`` would, on a CPU machine.

    python -m tests.e2e.cpu_host.openrlhf_launch openrlhf.cli.train_ppo_ray <OpenRLHF's flags>
    python -m tests.e2e.cpu_host.openrlhf_launch forkrl.plugins.openrlhf.train_ppo_ray <OpenRLHF's flags> \\
        --forkrl.tree_packing

Starts Ray first, with two fake GPUs (the policy and the reference actor ask for one each; the CPU
rollout asks for none) and :func:`.openrlhf_patches.apply_worker` as every worker's setup hook, applies
the driver's patch, then runs the module as ``__main__``. OpenRLHF's ``train`` finds Ray up and uses it
(it starts Ray only when none is running); everything after that is the launcher's own. Ray is local
to this process and ends with it. It sets :data:`CPU_ENV` before Ray starts (so Ray's processes and
workers inherit it); the caller puts the repository on ``PYTHONPATH`` (Ray workers import this package).
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

import ray

from . import openrlhf_patches

#: Logical resources: policy + reference hold 1 CPU and 1 GPU each; OpenRLHF's trainer actor needs a
#: free CPU to be placed (it holds none while running); the rollout holds none.
RAY_RESOURCES = dict(num_cpus=4, num_gpus=2)

#: DeepSpeed's CPU accelerator (gloo collectives); no idle Ray workers started ahead of need (each
#: costs CPU on a two-core machine); no usage reporting (no network).
CPU_ENV = {
    "DS_ACCELERATOR": "cpu",
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def main(argv: Sequence[str] | None = None) -> None:
    """Run the module ``argv[0]`` as ``__main__`` with the command line ``argv[1:]``, on the CPU stand-ins."""
    module, *args = sys.argv[1:] if argv is None else argv
    os.environ.update(CPU_ENV)
    ray.init(
        address="local",  # a new Ray of this process's own, never a running cluster found in /tmp/ray
        **RAY_RESOURCES,
        include_dashboard=False,
        runtime_env={"worker_process_setup_hook": f"{openrlhf_patches.__name__}.apply_worker"},
    )
    openrlhf_patches.apply_driver()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
