"""forkrl's vLLM plugin: the self-drafter's quantization and its re-sync inside vLLM's workers.

vLLM loads :func:`register` in every engine and worker process (entry point
``vllm.general_plugins``; forkrl must be installed where vLLM runs). It registers forkrl's
round-to-nearest drafter quantization under the names of
:data:`forkrl.core.speculative.vllm_engine.QUANT_METHODS` (:mod:`.quant`) and wraps
``GPUModelRunner.load_model`` so that a runner whose draft model uses one of them gets a
:class:`~.mirror.DrafterMirror` (:mod:`.mirror`): every host syncs new weights into vLLM's target
model only (TRL's ``sync_weights``, OpenRLHF's ``WorkerWrap``, veRL's ``update_weights_from_ipc``,
vLLM's own weight transfer), and the mirror re-quantizes them into the drafter before its next
draft, so the drafter is always the quantized current policy. Without a forkrl drafter nothing
changes. The hosts' flags build the engine's ``speculative_config``
(:func:`forkrl.core.speculative.vllm_engine.vllm_speculative_config`).

Checked against vLLM 0.29.0 (``tests/openrlhf/test_vllm_drafter.py::test_contract``).
"""

from __future__ import annotations

import functools
from typing import Any

from .mirror import DrafterMirror, install_mirror

__all__ = ["CHECKED", "DrafterMirror", "install_mirror", "register"]

CHECKED = "vllm 0.29.0"


def register() -> None:
    """vLLM plugin entry (``vllm.general_plugins``): forkrl's quantization methods and the drafter re-sync.

    Runs in every vLLM process (the engine core and each worker), any number of times.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from .quant import register_all

    register_all()

    if getattr(GPUModelRunner.load_model, "_forkrl_wrapped", False):
        return
    original = GPUModelRunner.load_model

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        install_mirror(self)

    load_model._forkrl_wrapped = True  # type: ignore[attr-defined]
    GPUModelRunner.load_model = load_model
