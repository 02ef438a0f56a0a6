"""MoE models with TRL's router load-balancing loss (``router_aux_loss_coef``) under tree_packing:
the same SGD updates as stock TRL on the same rollouts, for GRPO's fused and general paths and RLOO."""

from __future__ import annotations

import math

import pytest

trl = pytest.importorskip("trl")

from forkrl.core.testing.models import BYTE_MOE, byte_moe, byte_tokenizer, save_pretrained  # noqa: E402
from forkrl.core.testing.stock import assert_equals_stock, relative_difference  # noqa: E402

from .trl_helpers import initial_params, train, train_rloo  # noqa: E402

TOL = 1e-4
COEF = 0.5  # large enough that the router gradient is a visible part of the update


def save_tiny_moe(path, name: str) -> str:
    return save_pretrained(byte_moe(name, router_aux_loss_coef=COEF), byte_tokenizer(), path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {name: save_tiny_moe(tmp_path_factory.mktemp(name), name) for name in BYTE_MOE}


def _aux_logged(trainer) -> list[float]:
    return [h["aux_loss"] for h in trainer.state.log_history if "aux_loss" in h]


@pytest.mark.parametrize(
    "name,cfg",
    [
        ("qwen3moe", {}),  # on-policy: the fused pass (router counts from a decoder-only pass)
        ("qwen3moe", dict(beta=0.1)),  # KL: scoring pass first (the counts come from it)
        ("qwen3moe", dict(tree_mode="packed")),
        ("mixtral", dict(tree_mode="replay", tree_block_size=5)),
        ("gptoss", {}),
        ("olmoe", dict(num_iterations=2)),
    ],
    ids=[
        "qwen3moe-fused",
        "qwen3moe-kl",
        "qwen3moe-packed",
        "mixtral-replay",
        "gptoss",
        "olmoe-two-iterations",
    ],
)
def test_router_aux_loss_equals_stock(name, cfg, paths, tmp_path):
    path = paths[name]
    stock_cfg = {k: v for k, v in cfg.items() if not k.startswith("tree_")}
    stock, st = train(path, tmp_path / "stock", False, **stock_cfg)
    tree, tt = train(path, tmp_path / "tree", True, **cfg)
    init = initial_params(path)
    assert st.aux_loss_enabled and tt.aux_loss_enabled
    assert_equals_stock(stock, tree, init, TOL)
    a, b = _aux_logged(st), _aux_logged(tt)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert math.isclose(x, y, rel_tol=1e-4), (a, b)
    for ha, hb in zip(
        [h for h in st.state.log_history if "loss" in h],
        [h for h in tt.state.log_history if "loss" in h],
        strict=True,
    ):
        assert math.isclose(ha["loss"], hb["loss"], rel_tol=1e-4, abs_tol=1e-6), (ha["loss"], hb["loss"])


def test_router_aux_loss_is_part_of_the_update(paths, tmp_path):
    """The comparison above can fail: without the router loss the stock update differs by far more
    than its tolerance (the router gradient is not negligible in this setup)."""
    path = paths["qwen3moe"]
    with_aux, _ = train(path, tmp_path / "aux", False)
    without, _ = train(path, tmp_path / "noaux", False, router_aux_loss_coef=0.0)
    assert relative_difference(with_aux, without, initial_params(path)) > 100 * TOL


def test_rloo_router_aux_loss_equals_stock(paths, tmp_path):
    path = paths["qwen3moe"]
    stock, st = train_rloo(path, tmp_path / "stock", False)
    tree, tt = train_rloo(path, tmp_path / "tree", True)
    assert st.aux_loss_enabled
    assert_equals_stock(stock, tree, initial_params(path), TOL)
    for x, y in zip(_aux_logged(st), _aux_logged(tt), strict=True):
        assert math.isclose(x, y, rel_tol=1e-4)
