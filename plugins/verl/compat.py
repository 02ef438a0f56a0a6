"""Every veRL private the veRL plugin relies on, in one place.

Each :class:`~forkrl.core.compat.Private` (the one form core and every plugin use) names a
function, method, field or layout fact of veRL the plugin uses, the version it was read from, and
why; ``tests/verl/test_verl_contract.py`` checks every entry against the installed veRL, so an
upgrade that changes one fails in one test with the entry's name. The accessors below are the
plugin's only way into veRL's internals.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch

from forkrl.core.compat import Private
from forkrl.core.compat.probes import reads, takes

from ..fields import has_content

__all__ = [
    "CHECKED",
    "PRIVATES",
    "ROW_LOCAL_LOSSES",
    "Private",
    "fixed_micro_batch_count",
    "global_batch_info",
    "micro_batches",
    "multi_modal_rows",
    "micro_batches_of_any_size",
    "non_tensor",
    "postprocess",
    "prompt_lengths",
    "transformers_forwards",
    "ulysses_off",
]

CHECKED = "verl 0.9.1 (transformers 5.10.4, tensordict 0.10.0)"

#: veRL policy losses whose rows are weighted independently of the rows sharing their micro-batch
#: (per-token terms aggregated by ``agg_loss`` over the mini-batch's global counts): the losses
#: under which ``tree_balance`` may move rows between ranks (checked to exist in veRL's registry).
ROW_LOCAL_LOSSES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "dro", "cispo", "bypass_mode")


def _engine_methods() -> None:
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine, FSDPEngineWithLMHead

    takes(FSDPEngine.forward_backward_batch, "self", "data", "loss_function", "forward_only")
    takes(FSDPEngineWithLMHead.forward_step, "self", "micro_batch", "loss_function", "forward_only")
    reads(
        FSDPEngine.forward_backward_batch,
        *("batch_num_tokens", "dp_size", "prepare_micro_batches", "postprocess_batch_func", "sp_size"),
    )


def _autocast() -> None:
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine, FSDPEngineWithLMHead

    reads(FSDPEngine.__init__, "self._autocast_dtype = ")
    reads(FSDPEngineWithLMHead.forward_step, "_autocast_dtype")


def _micro_batching() -> None:
    from verl.workers.engine import utils

    takes(utils.prepare_micro_batches, "data", "dp_group", "num_batches_divided_by", "same_micro_num_in_dp")
    takes(utils.postprocess_batch_func, "output_lst", "indices", "data", exact=True)


def _output_layout() -> None:
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    # log-probs and entropies are nested over whole sequences, rolled by one (position t scores token t + 1)
    reads(
        FSDPEngineWithLMHead.prepare_model_outputs,
        *("nested_tensor_from_jagged(log_probs, cu_seqlens)", "input_ids_rmpad_rolled"),
    )


def _loss_slicing() -> None:
    from verl.workers.utils import padding

    # the response's scores, left-shifted by one
    reads(padding.no_padding_2_padding, "seq_offset - resp_len - 1 : seq_offset - 1")


def _actor_config() -> None:
    from verl.workers.config import FSDPActorConfig

    reads(FSDPActorConfig.__post_init__, 'object.__setattr__(self.engine, "strategy", self.strategy)')
    assert "fsdp_config" in {f for f in FSDPActorConfig.__dataclass_fields__}


def _registry() -> None:
    from verl.workers.engine.base import EngineRegistry

    takes(EngineRegistry.register, "model_type", "backend", "device")


def _balance_facts() -> None:
    from verl.trainer.ppo import core_algos
    from verl.workers.utils import padding

    reads(
        padding.left_right_2_no_padding,
        *('"max_seq_len"', '"max_response_len"', '"indices", indices', "unpad_input("),
    )
    reads(
        core_algos.agg_loss,
        *("/ batch_num_tokens * dp_size", "/ global_batch_size * dp_size", "horizon = loss_mask.shape[-1]"),
    )
    for name in ROW_LOCAL_LOSSES:
        core_algos.get_policy_loss_fn(name)


def _tensordict_utils() -> None:
    from verl.utils import tensordict_utils as tu

    for name in ("get_non_tensor_data", "assign_non_tensor"):
        assert callable(getattr(tu, name)), name
    # What carries() reads: the v1 agent loop's per-row multi_modal_inputs, {} for text rows.
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    reads(AgentLoopWorker._compute_multi_modal_inputs, "multi_modal_inputs = {}")


def _ulysses() -> None:
    from verl.models.transformers import monkey_patch
    from verl.utils import ulysses

    for name in ("get_ulysses_sequence_parallel_group", "set_ulysses_sequence_parallel_group"):
        assert callable(getattr(ulysses, name)), name
    reads(
        monkey_patch._ulysses_flash_attention_forward,
        "ulysses_sp_size = get_ulysses_sequence_parallel_world_size()",
        "if ulysses_sp_size > 1 and position_ids is not None",
    )


def _vlm_patches() -> None:
    from verl.models.transformers import monkey_patch
    from verl.utils import model

    # Class-level forwards veRL replaces for the Qwen-VL family (restored inside tree passes).
    reads(
        monkey_patch.apply_monkey_patch,
        "Qwen2VLModel.forward = qwen2_vl_base_forward",
        "Qwen2VLForConditionalGeneration.forward = forward_with_normal_backend",
        "Qwen2VLAttention.forward = qwen2_vl_attn_forward",
        "Qwen3VLModel.forward = qwen3_vl_base_forward",
    )
    # What the stock engine hands the model: the rows' multi_modal_inputs concatenated per key.
    reads(model.extract_multi_modal_inputs, "torch.cat(values, dim=0)")


def _prefix_grouper() -> None:
    import verl.workers.engine_workers as workers
    from verl.trainer.ppo.v1 import trainer_base
    from verl.workers.engine.fsdp import transformer_impl

    # Only veRL's legacy (v0) driver reads actor.use_prefix_grouper, to balance by uid group; its engine
    # never applies PrefixGrouper's attention (apply_monkey_patch is called without it).
    for module in (transformer_impl, workers, trainer_base):
        src = inspect.getsource(module)
        assert "prefix_grouper" not in src, module.__name__


PRIVATES: tuple[Private, ...] = (
    Private(
        "veRL",
        "FSDPEngine.forward_backward_batch / FSDPEngineWithLMHead.forward_step",
        "overridden (forward_backward_batch) and mirrored: the global token count, dp size and sp size it sets "
        "before micro-batching feed veRL's loss normalisation",
        _engine_methods,
        CHECKED,
    ),
    Private(
        "veRL",
        "FSDPEngine._autocast_dtype (set in __init__ and from mixed_precision.param_dtype; forward_step's autocast)",
        "the tree's passes run under the same autocast as veRL's forward_step (none when it is float32)",
        _autocast,
        CHECKED,
    ),
    Private(
        "veRL",
        "engine.utils.prepare_micro_batches / postprocess_batch_func",
        "the host's own micro-batch partition (fixed or dynamic) is kept, and its outputs reordered as stock",
        _micro_batching,
        CHECKED,
    ),
    Private(
        "veRL",
        "prepare_model_outputs: nested log_probs/entropy over whole rows, rolled by one",
        "the tree's scores are placed in the same layout (RowLayout.packed, align='next')",
        _output_layout,
        CHECKED,
    ),
    Private(
        "veRL",
        "workers.utils.padding.no_padding_2_padding",
        "veRL's loss reads the response's scores at [offset - resp_len - 1, offset - 1); prompt lengths come "
        "from the same fields",
        _loss_slicing,
        CHECKED,
    ),
    Private(
        "veRL",
        "FSDPActorConfig.__post_init__ copies actor.strategy onto engine_config",
        "forkrl's config subclass names the engine backend after that copy (the actor keeps strategy fsdp2)",
        _actor_config,
        CHECKED,
    ),
    Private(
        "veRL",
        "utils.ulysses.{get,set}_ulysses_sequence_parallel_group; _ulysses_flash_attention_forward",
        "the tree runs whole sequences on every rank of a Ulysses group: the group is unset inside its passes, "
        "so the patched attention entry does no all-to-all",
        _ulysses,
        CHECKED,
    ),
    Private(
        "veRL",
        "models.transformers.monkey_patch.apply_monkey_patch (Qwen-VL family); utils.model.extract_multi_modal_inputs",
        "veRL replaces the vision-language classes' forwards (its packed flash-attention, no cache): tree passes "
        "run transformers' own (transformers_forwards); each row's multi_modal_inputs are its images in order",
        _vlm_patches,
        CHECKED,
    ),
    Private(
        "veRL",
        "EngineRegistry.register",
        "forkrl's engine is registered under backend fsdp2_tree",
        _registry,
        CHECKED,
    ),
    Private(
        "veRL",
        "actor.use_prefix_grouper reaches neither the FSDP engine, the engine workers nor the v1 trainer",
        "accepted beside the tree as harmless (veRL's own prefix sharing would change the engine's forward)",
        _prefix_grouper,
        CHECKED,
    ),
    Private(
        "veRL",
        "verl.utils.tensordict_utils",
        "non-tensor batch fields (flags, normalisers)",
        _tensordict_utils,
        CHECKED,
    ),
    Private(
        "veRL",
        "left_right_2_no_padding's layout fields; agg_loss's global normalisers; the row-local policy losses",
        "tree_balance recomputes max_seq_len, max_response_len and indices for the moved rows, and moves rows "
        "only where every loss term is normalised by the mini-batch's global counts",
        _balance_facts,
        CHECKED,
    ),
)


# ---------------------------------------------------------------------------- accessors


def non_tensor(data, key: str, default=None):
    """A non-tensor field of a veRL batch (flags such as ``calculate_entropy``)."""
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def carries(data, key: str) -> bool:
    """Whether batch field ``key`` holds anything, not just whether it exists: veRL's v1 agent loop
    writes ``multi_modal_inputs`` for every row, an empty dict for a text row (``agent_loop_tq.py``)."""
    return key in data.keys() and has_content(data[key], unwrap=_plain)


def _plain(value):
    from tensordict.tensorclass import NonTensorData, NonTensorStack

    if isinstance(value, NonTensorStack):
        return value.tolist()
    if isinstance(value, NonTensorData):
        return value.data
    return value


def multi_modal_rows(data) -> list[dict] | None:
    """Per row, its ``multi_modal_inputs`` as a plain dict (``{}`` for a text row), or None when the
    batch has no such field: veRL's agent loop writes the processor's output per row
    (``pixel_values`` ``[patches, d]``, ``image_grid_thw`` ``[images, 3]``, ``images_seqlens``, ...)."""
    if "multi_modal_inputs" not in data.keys():
        return None
    rows = _plain(data["multi_modal_inputs"])
    if not isinstance(rows, (list, tuple)):
        raise ValueError(f"multi_modal_inputs: expected one dict per row, got {type(rows).__name__}")
    return [dict(_plain(r) or {}) for r in rows]


# ---------------------------------------------------------------------------- transformers' own forwards
#: Every veRL version checked (``CHECKED``) patches the classes below from this package.
_VERL_PATCH_PREFIX = "verl."
_PRISTINE: dict[str, object] = {}


def _pristine_module(name: str):
    """A fresh copy of transformers module ``name`` (not registered in ``sys.modules``): its
    functions are transformers' own even after veRL replaced them on the imported classes."""
    import importlib.util
    import sys

    if name not in _PRISTINE:
        spec = importlib.util.find_spec(name)
        copy_name = f"{name}_forkrl_pristine"
        copy_spec = importlib.util.spec_from_file_location(copy_name, spec.origin)
        module = importlib.util.module_from_spec(copy_spec)
        module.__package__ = name.rpartition(".")[0]  # its relative imports resolve to the real package
        sys.modules[copy_name] = module  # dataclasses look their module up while the class is built
        try:
            copy_spec.loader.exec_module(module)
        finally:
            del sys.modules[copy_name]
        _PRISTINE[name] = module
    return _PRISTINE[name]


@contextlib.contextmanager
def transformers_forwards(model: torch.nn.Module) -> Iterator[None]:
    """transformers' own ``forward`` on ``model``'s classes while the tree passes run.

    veRL's ``apply_monkey_patch`` replaces, class-wide, the Qwen-VL family's model and attention
    forwards with versions for its packed flash-attention layout (``qwen2_vl_attn_forward`` calls
    flash-attention directly and takes no key/value cache; ``forward_with_normal_backend`` needs
    its ``[4, 1, T]`` positions). A tree runs the decoder over its ancestors' cache and checks the
    model's plain forward at first use, so inside its passes each class whose ``forward`` comes
    from veRL gets transformers' back (from a fresh copy of its defining module), and veRL's again
    on exit (the stock engine in the same process keeps its own). Nothing changes for a class
    veRL did not patch (text models: veRL patches the flash-attention entry only).
    """
    swapped: list[tuple[type, object]] = []
    seen: set[type] = set()
    try:
        for module in model.modules():
            for cls in type(module).__mro__:
                if "forward" not in cls.__dict__:
                    continue
                fn = cls.__dict__["forward"]
                if cls not in seen and getattr(fn, "__module__", "").startswith(_VERL_PATCH_PREFIX):
                    own = getattr(_pristine_module(cls.__module__), cls.__name__).__dict__["forward"]
                    swapped.append((cls, fn))
                    cls.forward = own
                seen.add(cls)
                break
        yield
    finally:
        for cls, fn in reversed(swapped):
            cls.forward = fn


def autocast_dtype(engine) -> torch.dtype:
    """The dtype veRL's ``forward_step`` autocasts to (float32: no autocast). Read without a
    default: a veRL that renames it must fail here, not train in another precision."""
    return engine._autocast_dtype


def global_batch_info(engine, data) -> None:
    """What stock ``forward_backward_batch`` records before micro-batching: sp size, the global
    count of loss tokens (summed over the data-parallel group) and the dp size."""
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id

    tu.assign_non_tensor(data, sp_size=engine.ulysses_sequence_parallel_size)
    batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
    dist.all_reduce(batch_num_tokens, op=dist.ReduceOp.SUM, group=engine.get_data_parallel_group())
    tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
    tu.assign_non_tensor(data, dp_size=engine.get_data_parallel_size())


@contextlib.contextmanager
def ulysses_off(engine) -> Iterator[None]:
    """veRL's Ulysses attention switched off (its group unset) while the tree passes run.

    Under ``ulysses_sequence_parallel_size > 1`` veRL patches the model's flash-attention entry to
    all-to-all a sequence slice over the Ulysses group. The tree runs whole sequences on every rank,
    so an attention call that reaches the model's own implementation (the split attention does not
    apply) must stay local: with no group the patched entry is plain flash attention.
    """
    if engine.ulysses_sequence_parallel_size <= 1:
        yield
        return
    from verl.utils import ulysses

    previous = ulysses.get_ulysses_sequence_parallel_group()
    ulysses.set_ulysses_sequence_parallel_group(None)
    try:
        yield
    finally:
        ulysses.set_ulysses_sequence_parallel_group(previous)


def micro_batches(engine, data):
    """The host's micro-batches (and the dynamic-batching order), exactly as stock splits them."""
    from verl.workers.engine.utils import prepare_micro_batches

    return prepare_micro_batches(
        data=data, dp_group=engine.get_data_parallel_group(), same_micro_num_in_dp=True
    )


def fixed_micro_batch_count(data) -> int | None:
    """How many micro-batches of ``micro_batch_size_per_gpu`` stock splits ``data`` into (None under
    dynamic batching, whose token-budget split veRL already equalises over the dp ranks)."""
    size = int(non_tensor(data, "micro_batch_size_per_gpu", 0) or 0)
    if non_tensor(data, "use_dynamic_bsz", True) or size <= 0:
        return None
    return max(len(data) // size, 1)


def micro_batches_of_any_size(engine, data, count: int | None):
    """:func:`micro_batches`, for a rank whose row count the balancer may have changed: ``count``
    (:func:`fixed_micro_batch_count` of the rows before rebalancing) consecutive chunks of nearly equal
    sizes (every rank keeps the micro-batch count it came with: veRL's metrics aggregate per
    micro-batch over the dp ranks; only where the loss does not depend on the grouping,
    :mod:`forkrl.plugins.verl.balance`); ``None``: stock's split."""
    from verl.utils import tensordict_utils as tu

    rows = len(data)
    if count is None:
        return micro_batches(engine, data)
    if not 1 <= count <= rows:
        raise ValueError(f"tree_balance: {rows} rows cannot fill {count} micro-batches")
    bounds = [rows * i // count for i in range(count + 1)]
    chunks = [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
    return [tu.index_select_tensor_dict(data, chunk) for chunk in chunks], None


def postprocess(output_lst, indices, data):
    from verl.workers.engine.utils import postprocess_batch_func

    return postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)


def prompt_lengths(micro_batch) -> torch.Tensor:
    """Per row, the number of prompt tokens, read as ``no_padding_2_padding`` reads it."""
    prompts = micro_batch["prompts"]
    if prompts.is_nested:
        return prompts.offsets().diff()
    mask = micro_batch["attention_mask"]
    return mask[:, : prompts.shape[1]].sum(dim=1)
