"""The drafter kept equal to the quantized weights its target model has just loaded (inside vLLM's worker).

The mirror marks the drafter stale whenever the target's ``load_weights`` runs (every host's sync
and vLLM's reload end there) and, before the drafter's next ``propose``, re-quantizes the target's
freshly loaded weights into the drafter's existing buffers and copies its dense tensors
(embeddings, norms, LM head, biases): the same weights, in the same worker, no second transfer, no
new allocation (CUDA graphs captured on the drafter stay valid). The draft model's parameters
mirror the target's by name and shape (same architecture, same tensor-parallel split); a mismatch
is refused when the mirror is built. This module imports nothing of vLLM itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from forkrl.plugins.vllm.speculative import QUANT_METHODS

logger = logging.getLogger(__name__)

__all__ = ["DrafterMirror", "forkrl_drafter", "install_mirror"]


def forkrl_drafter(runner: Any) -> bool:
    """Whether ``runner``'s speculative config drafts with a forkrl-quantized draft model."""
    spec = getattr(runner, "speculative_config", None)
    return (
        spec is not None
        and getattr(spec, "method", None) == "draft_model"
        and getattr(spec, "quantization", None) in QUANT_METHODS
        and getattr(runner, "drafter", None) is not None
    )


def install_mirror(runner: Any) -> DrafterMirror | None:
    """Attach a :class:`DrafterMirror` to a vLLM model runner whose drafter is forkrl's (else None).

    Args:
        runner: a ``GPUModelRunner`` after ``load_model`` (``get_model()`` the target,
            ``get_draft_model()`` the draft model, ``drafter.propose`` its draft call).
    """
    if not forkrl_drafter(runner):
        return None
    mirror = DrafterMirror(runner.get_model(), runner.get_draft_model())
    mirror.attach(runner.drafter)
    runner.forkrl_mirror = mirror
    logger.info(
        "forkrl: drafter %s mirrors the target (%d quantized layers, %d dense tensors), re-synced after each weight load",
        runner.speculative_config.quantization,
        len(mirror.quantized),
        len(mirror.dense),
    )
    return mirror


class DrafterMirror:
    """Keeps a vLLM draft model equal to the quantized current weights of its target model.

    Args:
        target: the target model (vLLM module, dense weights).
        drafter: the draft model built with a forkrl quantization method from the same checkpoint.

    Raises:
        ValueError: a drafter tensor with no target tensor of the same name and shape (different
            architecture, or a different tensor-parallel split: set ``draft_tensor_parallel_size``
            to the engine's), or a quantized target.
    """

    def __init__(self, target: nn.Module, drafter: nn.Module) -> None:
        self.target, self.drafter = target, drafter
        targets = dict(target.named_modules())
        self.quantized: list[tuple[nn.Module, nn.Module]] = []
        self.dense: list[tuple[torch.Tensor, torch.Tensor]] = []
        problems = []
        for name, module in drafter.named_modules():
            method = getattr(module, "quant_method", None)
            source = targets.get(name)
            if hasattr(method, "requantize"):
                weight = getattr(source, "weight", None)
                shape = method.dense_shape(module)
                if (
                    not isinstance(weight, torch.Tensor)
                    or not weight.is_floating_point()
                    or tuple(weight.shape) != shape
                ):
                    problems.append(f"{name}: drafter {shape}, target {_describe(weight)}")
                    continue
                self.quantized.append((module, source))
                skip = {"weight"}  # requantize() takes it
            else:
                skip = set()
            for pname, p in module.named_parameters(recurse=False):
                if pname in skip:
                    continue
                src = getattr(source, pname, None) if source is not None else None
                if not isinstance(src, torch.Tensor) or src.shape != p.shape or src.dtype != p.dtype:
                    problems.append(
                        f"{name}.{pname}: drafter {tuple(p.shape)} {p.dtype}, target {_describe(src)}"
                    )
                    continue
                self.dense.append((p, src))
        if problems:
            raise ValueError(
                "forkrl's drafter cannot mirror this target: "
                + "; ".join(problems[:5])
                + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
                + ". The draft model must be the served policy, unquantized target, with the target's "
                "tensor-parallel split (draft_tensor_parallel_size = tensor_parallel_size)"
            )
        if not self.quantized:
            raise ValueError(
                "the draft model has no forkrl-quantized layer: is its quantization a forkrl method?"
            )
        self.stale = False
        self.syncs = 0
        self._wrap_target_loads()

    def _wrap_target_loads(self) -> None:
        original = self.target.load_weights

        @functools.wraps(original)
        def load_weights(weights: Iterable[tuple[str, torch.Tensor]], *args: Any, **kwargs: Any) -> Any:
            self.stale = True
            return original(weights, *args, **kwargs)

        self.target.load_weights = load_weights

    def attach(self, proposer: Any) -> None:
        """Re-sync before the proposer's next ``propose`` whenever the target loaded weights since."""
        original = proposer.propose

        @functools.wraps(original)
        def propose(*args: Any, **kwargs: Any) -> Any:
            self.sync_if_stale()
            return original(*args, **kwargs)

        proposer.propose = propose

    def sync_if_stale(self) -> bool:
        """Re-sync if the target loaded weights since the last sync; returns whether it did."""
        if not self.stale:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """Re-quantize the target's current weights into the drafter, in place."""
        for module, source in self.quantized:
            module.quant_method.requantize(module, source.weight)
        for dst, src in self.dense:
            dst.copy_(src)
        self.stale = False
        self.syncs += 1


def _describe(t: Any) -> str:
    return "missing" if not isinstance(t, torch.Tensor) else f"{tuple(t.shape)} {t.dtype}"
