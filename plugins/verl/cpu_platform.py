"""A veRL device platform for a machine without an accelerator, for CPU smoke runs
(:mod:`forkrl.plugins.verl.cpu_run`) and forkrl's tests; not for training.

veRL 0.9.1 knows nvidia/npu/rocm platforms only and asks its platform for the device module,
the current device and the collective backend. :class:`CPUPlatform` answers those for the CPU:
memory queries give zeros, the current device is ``"cpu"``, the backend is gloo. Tensors stay
where torch puts them; no kernel changes. Under Ray it claims the ``"GPU"`` resource, which a CPU
run declares (``ray_init.num_gpus``) so that veRL's placement groups can be scheduled.

Nothing registers it unless asked: :func:`register` adds it to veRL's ``PlatformRegistry`` under
:data:`NAME` (selected with ``VERL_PLATFORM=forkrl_cpu``; it never offers itself to veRL's
auto-detection, :meth:`CPUPlatform.is_platform_available`), and an in-process caller may pass an
instance to veRL's ``set_platform``.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType, SimpleNamespace

import torch
from verl.plugin.platform.platform_base import PlatformBase

from .cpu_run import PLATFORM

__all__ = ["NAME", "CPUPlatform", "register"]

#: The platform's name for ``VERL_PLATFORM``.
NAME = PLATFORM


class _CPUDeviceModule(ModuleType):
    """What veRL reads from ``torch.cuda``-like device modules, answered for the CPU."""

    def __init__(self) -> None:
        super().__init__("forkrl_cpu_device")

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, *a):
        pass

    def synchronize(self, *a):
        pass

    def empty_cache(self):
        pass

    def max_memory_allocated(self, *a, **k):
        return 0

    def max_memory_reserved(self, *a, **k):
        return 0

    def memory_allocated(self, *a, **k):
        return 0

    def memory_reserved(self, *a, **k):
        return 0

    def reset_peak_memory_stats(self, *a, **k):
        pass

    def mem_get_info(self, *a, **k):
        return (1 << 34, 1 << 34)

    def manual_seed(self, s):
        torch.manual_seed(s)

    def manual_seed_all(self, s):
        torch.manual_seed(s)

    def get_device_name(self, *a):
        return "cpu"

    def get_rng_state(self, *a):
        return torch.get_rng_state()

    def set_rng_state(self, s, *a):
        torch.set_rng_state(s)

    def Stream(self, *a, **k):
        return None

    def current_stream(self, *a, **k):
        return SimpleNamespace(wait_stream=lambda *a: None, synchronize=lambda: None)

    def stream(self, *a, **k):
        return contextlib.nullcontext()

    def is_bf16_supported(self):
        return True


_MODULE = _CPUDeviceModule()


class CPUPlatform(PlatformBase):
    """veRL's platform interface on the CPU (gloo collectives, no device memory)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: a machine with a GPU must not fall onto this platform.
        return False

    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"  # the run declares fake GPUs: veRL's placement groups ask for them

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False  # veRL's weight sync then takes its shared-memory path

    def rollout_env_vars(self) -> dict[str, str]:
        """What veRL sets in its rollout servers' processes (vLLM's CPU build, where installed):
        forkrl's vLLM plugin keeps linear weights dense, since vLLM's CPU worker repacks them into a
        form that takes no ``load_weights`` (veRL's sync), and vLLM's CPU cache gets 1 GiB unless set."""
        from forkrl.plugins.vllm import DENSE_CPU

        return {DENSE_CPU: "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}

    def cudart(self) -> None:
        return None


def register() -> None:
    """Add :class:`CPUPlatform` to veRL's ``PlatformRegistry`` as :data:`NAME` (idempotent)."""
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get(NAME) is not CPUPlatform:
        PlatformRegistry.register(platform=NAME)(CPUPlatform)
