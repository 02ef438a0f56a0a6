"""Every private of transformers and torch that ``forkrl.core`` relies on, in one place, by area.

Each :class:`Private` (:mod:`.registry`, the one form core and every plugin use) names an
attribute, op or field the rest of core uses, the versions it was checked against, and why forkrl
needs it; the accessors in this package are the only code in core that touches them (the
cache-layer subclasses in :mod:`forkrl.core.executor.cache` and the sampler's ragged cache override
the public layer methods and reach the internal fields through here). ``tests/core/test_compat.py``
checks every entry, so an upgrade that moves one fails in one place with the entry's name and reason.

Areas: :mod:`.attention` (implementation selection, the attention registry, checkpointing),
:mod:`.cache` (cache layers), :mod:`.ssm` (the Mamba-2 step), :mod:`.scan` (the Mamba-1 scan),
:mod:`.mla` (latent attention modules), :mod:`.kernels` (torch's attention ops), :mod:`.lowbit`
(weight-only matmuls), :mod:`.fsdp` (FSDP2), :mod:`.deepspeed` (ZeRO-3 partitions), :mod:`.vision`
(vision-language modelling internals), :mod:`.weights` (tied weights). Importing the
package imports every area; :data:`PRIVATES` gathers their entries.
"""

from __future__ import annotations

from . import attention, cache, fsdp, kernels, lowbit, mla, scan, ssm, vision, weights
from .attention import (
    attention_implementation,
    checkpointing_off,
    register_attention,
    set_attention_implementation,
    set_checkpointing,
    set_experts_implementation,
)
from .cache import (
    Cache,
    DummyLayer,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
    conv_past,
    init_cache,
    mark_initialized,
    record_past,
    replace_layers,
    seed_layer,
    seed_sliding_layer,
    seed_state_layer,
    store_conv_state,
    store_recurrent_state,
)
from .deepspeed import (
    engine_hooks_of,
    is_zero3_param,
    set_tensor,
    whole_shape,
)
from .fsdp import (
    dtensor_mesh,
    fsdp2_param_dtype,
    fsdp2_plain_class,
    full_tensor,
    is_dtensor,
    is_fsdp2_module,
    reduce_scatter_like,
)
from .kernels import (
    efficient_cuda,
    efficient_cuda_backward,
    flash_cpu,
    flash_cpu_backward,
    flash_cuda,
    flash_cuda_backward,
    has_flash_cuda,
)
from .lowbit import (
    int4_mm,
    int4_pack,
    int8_mm,
)
from .mla import (
    expand_kv_replaced,
    has_forward_hooks,
    mla_modules,
)
from .registry import (
    CHECKED,
    Private,
    function_source,
    parameter_names,
)
from .scan import (
    mixer_layer,
    next_recurrent_state,
    scan_mixers,
    scan_replaced,
    take_recurrent_state,
)
from .ssm import (
    out_of_place_ssm_step,
    ssm_step_modules,
)
from .vision import gemma3_vision_masks, llava_next_crops, rope_index, vision_tower
from .weights import tied_weight_names

__all__ = [
    "efficient_cuda",
    "efficient_cuda_backward",
    "has_forward_hooks",
    "gemma3_vision_masks",
    "llava_next_crops",
    "rope_index",
    "vision_tower",
    "CHECKED",
    "Cache",
    "DummyLayer",
    "DynamicCache",
    "DynamicLayer",
    "DynamicSlidingWindowLayer",
    "LinearAttentionAndFullAttentionLayer",
    "LinearAttentionLayer",
    "PRIVATES",
    "Private",
    "attention_implementation",
    "checkpointing_off",
    "conv_past",
    "dtensor_mesh",
    "engine_hooks_of",
    "expand_kv_replaced",
    "flash_cpu",
    "flash_cpu_backward",
    "flash_cuda",
    "flash_cuda_backward",
    "fsdp2_param_dtype",
    "fsdp2_plain_class",
    "full_tensor",
    "function_source",
    "has_flash_cuda",
    "init_cache",
    "int4_mm",
    "int4_pack",
    "int8_mm",
    "is_dtensor",
    "is_fsdp2_module",
    "is_zero3_param",
    "mark_initialized",
    "mixer_layer",
    "mla_modules",
    "next_recurrent_state",
    "out_of_place_ssm_step",
    "parameter_names",
    "record_past",
    "reduce_scatter_like",
    "register_attention",
    "replace_layers",
    "scan_mixers",
    "scan_replaced",
    "seed_layer",
    "seed_sliding_layer",
    "seed_state_layer",
    "set_attention_implementation",
    "set_checkpointing",
    "set_experts_implementation",
    "set_tensor",
    "ssm_step_modules",
    "store_conv_state",
    "store_recurrent_state",
    "take_recurrent_state",
    "tied_weight_names",
    "whole_shape",
]

#: Every core entry, area by area (``tests/core/test_compat.py`` checks each).
PRIVATES: tuple[Private, ...] = (
    *attention.PRIVATES,
    *cache.PRIVATES,
    *ssm.PRIVATES,
    *scan.PRIVATES,
    *mla.PRIVATES,
    *kernels.PRIVATES,
    *lowbit.PRIVATES,
    *fsdp.PRIVATES,
    *vision.PRIVATES,
    *weights.PRIVATES,
)
