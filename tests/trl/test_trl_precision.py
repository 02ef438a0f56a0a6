"""TRL in the precision users train in: its default ``bf16=True`` (autocast over float32 parameters)
and bf16 parameters, for a zoo of architectures and the configurations that take the tree scorer
(``beta > 0``, ``num_iterations > 1``, RLOO, evaluation).

bf16 runs never equal each other to float tolerance, so each comparison is taken on the whole
parameter update after three SGD steps (stock float32, stock bf16 and forkrl bf16 on the same
rollouts), with ``gap = |stock_bf16 - stock_fp32|``:

- bf16 parameters (the OpenRLHF bf16 criterion): ``|tree - stock_bf16| < 0.5 * gap``; the
  parameters' own rounding dominates the gap (measured 0.23-0.35).
- autocast over float32 parameters: ``0.5 * gap <= |tree - stock_fp32| <= 1.5 * gap`` (the tree is a
  bf16 computation as accurate as stock: measured 0.99-1.05) and ``|tree - stock_bf16| <
  1.5 * gap`` (measured 0.78-1.02). The tighter ``0.5 * gap`` is out of reach by construction: a
  shared prefix is computed once and its gradient summed before the weight products, so the bf16
  roundings are other roundings (stock itself, with the same rows split into other micro-batches,
  moves by 0.42 of the gap; the packed-mask tree, which shares no cache, by 0.78).
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from forkrl.core.testing import Bf16Rounding  # noqa: E402
from forkrl.core.testing.models import byte_model, byte_tokenizer, save_pretrained  # noqa: E402

from .trl_helpers import initial_params, prompt_dataset, train, train_rloo  # noqa: E402

ZOO = ["llama-gqa", "qwen2", "qwen3", "gemma2", "qwen3moe", "lfm2"]
# TRL's default config on every architecture of the core zoo would repeat tests/core/test_precision.py
# at three times the cost (CI time): one of each kind here (GQA attention, q/k norms, MoE with the
# router loss, conv state); Gemma2 and Qwen3 also train in bf16 weights below.
AUTOCAST_ZOO = ["llama-gqa", "qwen3", "qwen3moe", "lfm2"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    extra = {"qwen3moe": {"router_aux_loss_coef": 0.5}}
    return {
        n: save_pretrained(byte_model(n, **extra.get(n, {})), byte_tokenizer(), tmp_path_factory.mktemp(n))
        for n in ZOO
    }


def _update(params: dict[str, torch.Tensor], init: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(params[n].double() - init[n].double()).flatten() for n in sorted(params)])


def _three(run, path, tmp_path, **cfg):
    """The updates of stock float32, stock bf16 and forkrl bf16 (``cfg`` to all three)."""
    init = {
        n: p.to(torch.bfloat16) if cfg.get("model_init_kwargs") else p
        for n, p in initial_params(path).items()
    }
    out = []
    for label, forkrl, bf16 in (("fp32", False, False), ("stock", False, True), ("tree", True, True)):
        kw = dict(cfg) if bf16 else {k: v for k, v in cfg.items() if k != "model_init_kwargs"}
        params, trainer = run(path, tmp_path / label, forkrl, bf16=bf16, **kw)
        if forkrl:
            assert trainer.forkrl is not None and trainer.args.bf16
        out.append(_update(params, init))
    return out


def _check_autocast(exact, stock, tree, label: str) -> None:
    assert float((stock - exact).norm()) > 1e-4 * float(exact.norm()), f"{label}: bf16 did not round anything"
    Bf16Rounding(label, tree, stock, exact).check_follows(near=1.5)


@pytest.mark.parametrize("name", AUTOCAST_ZOO)
def test_trl_default_bf16_autocast(name, paths, tmp_path):
    """TRL's default config (bf16 autocast) on each architecture: the tree update is a bf16 update as
    accurate as stock's (MoE: with the router loss; LFM2: conv state carried across nodes)."""
    _check_autocast(*_three(train, paths[name], tmp_path), name)


@pytest.mark.parametrize(
    "cfg",
    [dict(num_iterations=2), dict(beta=0.1, num_iterations=2, tree_mode="replay")],
    ids=["two-iterations", "kl-two-iterations-replay"],
)
def test_trl_bf16_with_tree_scoring(cfg, paths, tmp_path):
    """Reference and old-policy log-probs scored by the tree under autocast (these crashed in the
    CPU flash kernel on mixed float32/bf16 inputs)."""
    tree = {k: v for k, v in cfg.items() if k.startswith("tree_")}
    stock_cfg = {k: v for k, v in cfg.items() if k not in tree}
    path = paths["qwen3"]
    init = initial_params(path)
    exact = _update(train(path, tmp_path / "fp32", False, bf16=False, **stock_cfg)[0], init)
    stock = _update(train(path, tmp_path / "stock", False, bf16=True, **stock_cfg)[0], init)
    mine, trainer = train(path, tmp_path / "tree", True, bf16=True, **cfg)
    assert any("tree/score_time" in h and h["tree/score_time"] > 0 for h in trainer.state.log_history)
    _check_autocast(exact, stock, _update(mine, init), str(cfg))


def test_rloo_bf16(paths, tmp_path):
    """RLOO (old log-probs always tree-scored) under TRL's default autocast."""
    _check_autocast(*_three(train_rloo, paths["llama-gqa"], tmp_path), "rloo")


@pytest.mark.parametrize("name", ["qwen3", "gemma2"])
def test_trl_bf16_parameters(name, paths, tmp_path):
    """bf16 weights (``model_init_kwargs={"dtype": "bfloat16"}``): within half of bf16's own gap of stock."""
    exact, stock, tree = _three(train, paths[name], tmp_path, model_init_kwargs={"dtype": "bfloat16"})
    Bf16Rounding(name, tree, stock, exact).check_within_half()


def test_evaluation_under_bf16_scores_with_the_tree(paths, tmp_path):
    """Evaluation at every step with TRL's default bf16 (the smallest case: evaluation at step 1 under
    autocast): it runs, scores with the tree, and its loss is stock's within bf16 rounding."""
    evals = prompt_dataset(4)
    stock = train(
        paths["qwen2"],
        tmp_path / "s",
        False,
        bf16=True,
        eval_strategy="steps",
        eval_steps=1,
        eval_dataset=evals,
    )[1]
    tree = train(
        paths["qwen2"],
        tmp_path / "t",
        True,
        bf16=True,
        eval_strategy="steps",
        eval_steps=1,
        eval_dataset=evals,
    )[1]
    losses = [[h["eval_loss"] for h in t.state.log_history if "eval_loss" in h] for t in (stock, tree)]
    assert len(losses[1]) == 3 and len(losses[0]) == 3
    for a, b in zip(*losses, strict=True):
        assert abs(a - b) <= 2e-2 * max(1.0, abs(a)), losses


def test_speculative_rollout_under_bf16_keeps_greedy_rollouts(tmp_path):
    """``speculative_rollout`` with TRL's default bf16 autocast: the drafter (quantized from the
    float32 weights) and the policy's verification run under TRL's autocast, and greedy completions
    are token-identical to stock TRL's (deterministic here; in bf16 a near-tie could flip an argmax
    between a one-token and a multi-token forward, in stock generation as well)."""
    from .trl_helpers import SPEC, run_recording_rollouts, save_tiny_llama

    path = save_tiny_llama(tmp_path / "m")
    greedy = dict(generation_kwargs={"do_sample": False}, bf16=True)
    seen_stock, seen_spec = [], []
    run_recording_rollouts(path, tmp_path / "s", False, seen_stock, **greedy)
    _, trainer = run_recording_rollouts(path, tmp_path / "t", True, seen_spec, **greedy, **SPEC)
    assert len(seen_spec) == 24 and seen_spec == seen_stock
    assert any(h.get("spec/target_calls", 0) > 0 for h in trainer.state.log_history)


@pytest.mark.parametrize("precision", ["fp32_accumulate", "fp32"])
def test_head_precision_is_trls_fused_lm_head(precision):
    """The tree's LM head in TRL's precision (``head_precision``) against TRL's own chunked log-prob
    kernel under bf16 autocast: log-probs, entropies and the gradients of hidden states and weight
    (TRL sums the gradient products in float32; ``cast_lm_head_to_fp32`` runs the head in float32)."""
    from trl.kernels import ChunkedLogProbFunction

    from forkrl.core.executor.model import ModelAdapter

    model = byte_model("llama-gqa")
    adapter = ModelAdapter(model)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 32, generator=g)
    targets = torch.randint(0, 256, (7,), generator=g)
    c_lp, c_ent = torch.randn(7, generator=g), torch.randn(7, generator=g)
    weight = model.lm_head.weight

    def ours():
        h = hidden.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp = torch.log_softmax(adapter.logits(h, 0.7, precision), -1)
            lp, ent = logp[torch.arange(7), targets], -(logp.exp() * logp).sum(-1)
            ((lp * c_lp).sum() + (ent * c_ent).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, weight.grad

    def trls():
        h = hidden.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            lp, ent, *_ = ChunkedLogProbFunction.apply(
                h, weight, None, targets, 0.7, 64, None, 1.0, ("entropy",)
            )
        ((lp * c_lp).sum() + (ent * c_ent).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, weight.grad

    got = ours()
    weight.grad = None
    want = trls()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
