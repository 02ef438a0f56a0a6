"""CUDA paths of tree training (skipped without a GPU; ``scripts/gpu_check.py`` runs the same checks
and measures them): the split attention with the CUDA flash kernels, sibling batches, the executor
against per-sequence autograd, packed mode's FlexAttention BlockMask (forward and backward)."""

from __future__ import annotations

import pytest
import torch

from forkrl.core import PrefixForest, TreeExecutor
from forkrl.core.testing.forests import deep_tree, grpo_group
from forkrl.core.testing.models import dense_logprobs, grads, max_rel_err
from forkrl.core.testing.models import tiny_causal_lm as make_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Relative to the largest reference norm: float32 with TF32 off, bf16 against the same dtype's dense.
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def test_split_attention_picks_the_cuda_flash_kernels_in_half_precision():
    from forkrl.core.attention import kernels_for

    device = torch.device("cuda")
    assert kernels_for(device, torch.bfloat16) is not None
    assert kernels_for(device, torch.float32) is None  # the flash kernel takes half precision only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["keep", "replay", "packed"])
@pytest.mark.parametrize("forest_name", ["grpo", "deep"])
def test_executor_on_cuda_equals_dense(dtype, mode, forest_name):
    model = make_model("llama-gqa", dtype=dtype).cuda()
    seqs, sf = grpo_group(group=6) if forest_name == "grpo" else deep_tree()
    g = torch.Generator().manual_seed(3)
    coefs = [torch.randn(len(s) - f, generator=g).cuda() for s, f in zip(seqs, sf, strict=True)]
    model.zero_grad(set_to_none=True)
    lps, _ = dense_logprobs(model, seqs, sf)
    sum((lp * c).sum() for lp, c in zip(lps, coefs, strict=True)).backward()
    want = grads(model)
    model.zero_grad(set_to_none=True)
    res = TreeExecutor(model, mode=mode, block_size=3 if mode == "replay" else None).backward(
        PrefixForest.build(seqs, sf), coefs
    )
    assert max_rel_err([lp.float() for lp in res.logprobs], [lp.detach().float() for lp in lps]) < TOL[dtype]
    assert max_rel_err([x.float() for x in grads(model)], [w.float() for w in want]) < TOL[dtype]


def test_packed_mode_uses_flex_attention_on_cuda():
    from forkrl.core.executor import packed

    model = make_model("llama-gqa", dtype=torch.float32).cuda()
    seqs, sf = deep_tree()
    TreeExecutor(model, mode="packed").score(PrefixForest.build(seqs, sf))
    assert packed._use_flex(torch.device("cuda")), "FlexAttention failed on this device (see the log)"


@pytest.mark.parametrize("mode", ["keep", "replay", "packed"])
def test_router_loss_on_cuda_in_float64(mode):
    """The MoE router loss with its sums on the device (no host sync per forward): float64 on CUDA
    against the model's own aux per padded micro-batch, as tests/core/test_router.py on the CPU."""
    from forkrl.core.executor import RouterLoss
    from forkrl.core.testing import Float64Mode
    from forkrl.core.testing.router import router_window, stock_router_losses

    with Float64Mode():
        model = make_model("qwen3moe").cuda()
        seqs, sf, rows = router_window()
        weights = [0.3, 0.7, 0.5]
        coefs = [torch.randn(len(s) - f, dtype=torch.float64) for s, f in zip(seqs, sf, strict=True)]
        want_values = stock_router_losses(model, seqs, sf, rows, weights, [c.cuda() for c in coefs])
        want = grads(model)
        model.zero_grad(set_to_none=True)
        forest = PrefixForest.build(seqs, sf)
        router = RouterLoss(weights).bind(forest, rows)
        TreeExecutor(model, mode=mode, block_size=3 if mode == "replay" else None).backward(
            forest, grad_logprobs=coefs, router=router
        )
    assert max_rel_err(grads(model), want) < 1e-9
    assert router.values().device.type == "cuda"
    torch.testing.assert_close(router.values().cpu(), want_values.cpu(), rtol=1e-9, atol=0)
