"""Test-only: a CPU platform for veRL 0.9.1, so that its real TrainingWorker and FSDP2 engine run here.

veRL has no CPU platform and assumes CUDA (device module, current device, NCCL). Registered through
veRL's own ``PlatformRegistry`` and selected with ``set_platform`` before anything asks for the
platform: the device module answers memory queries with zeros and the current device is "cpu", the
backend is gloo. veRL's log-softmax and entropy take float32 from bf16 logits, as its GPU kernels
do (:func:`_float32_softmax`; a no-op in float32). Nothing here is used outside the tests.
"""

import contextlib
from types import ModuleType, SimpleNamespace

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform


class _CPUDeviceModule(ModuleType):
    def __init__(self):
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


@PlatformRegistry.register(platform="forkrl_cpu")
class CPUPlatform(PlatformBase):
    @property
    def device_name(self):
        return "cpu"

    @property
    def vendor_name(self):
        return "cpu"

    @property
    def device_module(self):
        return _MODULE

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return (None, None)

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


_MODULE = _CPUDeviceModule()


def _float32_softmax(fn):
    """``fn`` on half-precision logits upcast to float32 first: on a GPU veRL's log-probs come from
    flash-attn's cross-entropy kernel, and its entropy from softmax/logsumexp under CUDA autocast,
    both float32 computations from bf16 logits; CPU autocast keeps those ops in bf16."""

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
