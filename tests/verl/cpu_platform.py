"""Test-only: veRL 0.9.1 in this process on the CPU, so that its real TrainingWorker and FSDP2 engine
run here without Ray.

The platform is the product's (:class:`forkrl.plugins.verl.cpu_platform.CPUPlatform`, the one CPU
smoke runs use), set with veRL's ``set_platform`` before anything asks for it. Two test-only
adjustments on top: the Ulysses device mesh's device name, which veRL reads at import; and veRL's
log-softmax and entropy take float32 from bf16 logits, as its GPU kernels do
(:func:`_float32_softmax`; a no-op in float32), so that the precision tests compare what a GPU run
computes.
"""

from verl.plugin.platform.platform_manager import set_platform

from forkrl.plugins.verl.cpu_platform import CPUPlatform

__all__ = ["CPUPlatform", "install"]


def _float32_softmax(fn):
    """``fn`` on half-precision logits upcast to float32 first: on a GPU veRL's log-probs come from
    flash-attn's cross-entropy kernel, and its entropy from softmax/logsumexp under CUDA autocast,
    both float32 computations from bf16 logits; CPU autocast keeps those ops in bf16."""
    import torch

    def upcast(logits, *args, **kwargs):
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return fn(logits, *args, **kwargs)

    return upcast


def install() -> None:
    set_platform(CPUPlatform())
    import verl.utils.torch_functional as verl_F
    from verl.workers.engine.fsdp import transformer_impl

    transformer_impl.device_name = "cpu"  # read at import, before this platform: Ulysses' device mesh
    # Before any engine exists (the engine binds entropy_from_logits in __init__).
    if not getattr(transformer_impl.logprobs_from_logits, "forkrl_float32", False):
        transformer_impl.logprobs_from_logits = _float32_softmax(transformer_impl.logprobs_from_logits)
        verl_F.entropy_from_logits = _float32_softmax(verl_F.entropy_from_logits)
        transformer_impl.logprobs_from_logits.forkrl_float32 = True
