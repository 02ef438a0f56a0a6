"""TRL with ``long_context_cp_size``: long prompts split over groups of accelerate's processes.

Each process keeps its own rollouts and TRL's own loss on them; a group of C processes trains and
scores their union with every prompt's cache split over the group (small blocks, so every prompt
runs several rounds). The parameters after two SGD steps must equal stock TRL in one process with
the same global batch, and the context-parallel executor must be the one that ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forkrl.core.testing.ranks import run_in_subprocess, run_on_ranks
from forkrl.core.testing.stock import assert_equals_stock

pytest.importorskip("trl")

from .trl_helpers import initial_params, prompt_dataset, save_tiny_llama, train, train_rloo  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _cp_train(
    model: str, out: Path, per_device: int, cp: int, bf16: bool = False, checkpointing: bool = False
) -> dict | None:
    """Two steps of stock TRL (``cp`` 0) or the plugin with ``long_context_cp_size=cp`` (prompts of
    about 80 tokens: several replay blocks); the main process returns what it trained and ran."""
    from forkrl.core.executor.cp_executor import ContextParallelExecutor

    kw = dict(dataset=prompt_dataset(16), per_device_train_batch_size=per_device, max_steps=2, bf16=bf16)
    kw["gradient_checkpointing"] = checkpointing
    if cp:
        kw.update(long_context_replay=True, long_context_cp_size=cp, tree_block_size=8, beta=0.04)
    else:
        kw.update(beta=0.04)
    params, tr = train(model, out / f"cp{cp}-{bf16}", bool(cp), **kw)
    if not tr.accelerator.is_main_process:
        return None
    executors = [e for _, e in tr.forkrl.tree()._executors.values()] if cp else []
    return {
        "params": params,
        "world": tr.accelerator.num_processes,
        "cp": sum(isinstance(e, ContextParallelExecutor) for e in executors),
        "tokens": [h["tree/unique_tokens"] for h in tr.state.log_history if "tree/unique_tokens" in h],
    }


@pytest.mark.slow
@pytest.mark.parametrize("world, cp, checkpointing", [(2, 2, True), (4, 2, False)])
def test_prompts_split_over_groups_of_processes_equal_stock(model_path, tmp_path, world, cp, checkpointing):
    """Old-policy, reference (beta > 0) and training passes all split over the group; the update is
    stock TRL's with the same global batch in one process (with TRL's default gradient checkpointing,
    which the tree's replay replaces, on two processes)."""
    init = initial_params(model_path)
    args = (model_path, tmp_path, 2, cp, False, checkpointing)
    got = run_on_ranks(_cp_train, world, *args, init_group=False, timeout=900)[0]
    assert got["world"] == world and got["cp"] >= 2, got  # the policy's and the reference's executors
    one = run_in_subprocess(_cp_train, model_path, tmp_path, 2 * world, 0, False, checkpointing)
    assert_equals_stock(one["params"], got["params"], init, TOL)


@pytest.mark.slow
def test_under_bf16_autocast_the_split_update_is_as_accurate_as_stock(model_path, tmp_path):
    """TRL's default precision (bf16 autocast): the group's update is a bf16 update as accurate as
    stock's (tests/trl/test_trl_precision.py's criterion), against stock in one process."""
    from forkrl.core.testing import Bf16Rounding

    init = initial_params(model_path)
    update = lambda p: torch.cat([(p[n].double() - init[n].double()).flatten() for n in sorted(p)])  # noqa: E731
    tree = run_on_ranks(_cp_train, 2, model_path, tmp_path, 2, 2, True, init_group=False, timeout=900)[0]
    exact = run_in_subprocess(_cp_train, model_path, tmp_path, 4, 0, False)
    stock = run_in_subprocess(_cp_train, model_path, tmp_path, 4, 0, True)
    exact, stock, tree = update(exact["params"]), update(stock["params"]), update(tree["params"])
    assert float((stock - exact).norm()) > 1e-4 * float(exact.norm()), "bf16 did not round anything"
    Bf16Rounding("long_context_cp_size=2, bf16 autocast", tree, stock, exact).check_follows(near=1.5)


def _rloo_train(model: str, out: Path, cp: int) -> dict | None:
    """Two RLOO steps on two processes, TRL's own seeded generation (the same in both runs): stock
    DDP (``cp`` 0) or the plugin with ``long_context_cp_size=cp``."""
    kw = dict(long_context_replay=True, long_context_cp_size=cp, tree_block_size=8) if cp else {}
    params, tr = train_rloo(model, out / f"rloo{cp}", bool(cp), max_steps=2, **kw)
    return {"params": params} if tr.accelerator.is_main_process else None


@pytest.mark.slow
def test_rloo_split_over_two_processes_equals_stock_ddp(model_path, tmp_path):
    init = initial_params(model_path)
    got = run_on_ranks(_rloo_train, 2, model_path, tmp_path, 2, init_group=False, timeout=900)[0]
    stock = run_on_ranks(_rloo_train, 2, model_path, tmp_path, 0, init_group=False, timeout=900)[0]
    assert_equals_stock(stock["params"], got["params"], init, TOL)


def test_long_context_cp_size_rules(tmp_path):
    """Refused in the config, before any model or process group: a size without long-context replay,
    a non-positive size, and row balancing that would move rows out of their group."""
    from forkrl.plugins import trl as ftrl

    from .trl_helpers import base_args

    args = base_args(tmp_path)
    with pytest.raises(ValueError, match="set long_context_replay=True"):
        ftrl.GRPOConfig(**args, tree_packing=True, long_context_cp_size=2)
    with pytest.raises(ValueError, match="positive integer"):
        ftrl.GRPOConfig(**args, long_context_replay=True, long_context_cp_size=0)
    with pytest.raises(ValueError, match="tree_balance='auto'"):
        ftrl.GRPOConfig(**args, long_context_replay=True, long_context_cp_size=2, tree_balance="on")
    ftrl.GRPOConfig(**args, long_context_replay=True, long_context_cp_size=2)


def test_a_size_that_does_not_divide_the_processes_is_refused_at_setup(model_path, tmp_path):
    """One process and long_context_cp_size=2: refused when the trainer is built, naming the fix."""
    with pytest.raises(ValueError, match=r"must divide the number of processes \(1\)"):
        train(model_path, tmp_path, True, long_context_replay=True, long_context_cp_size=2, max_steps=1)
