"""TRL's side of the tree loop: :class:`TRLHost`, the :class:`forkrl.core.train.HostAdapter` a
TRL trainer gives its :class:`~forkrl.core.train.TreeRunner`.

What is TRL's and so lives here: its prepared micro-batches (``prompt_ids``/``completion_ids``,
left-padded prompts and right-padded completions) as row layouts and images, its loss
(``compute_loss`` per micro-batch on the tree's leaves, scaled as transformers' ``training_step``
scales it), the router weights its loss applies, its rebalancing (:mod:`.balance`), DeepSpeed's
hand-over (accelerate's ``backward`` split: the engine's backward inside the step, its optimizer
step after), and its metrics sink. The trainer (:mod:`.trainer`) decides when a window is complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from forkrl.core import RowLayout
from forkrl.core.balance import CostModel, Rebalanced
from forkrl.core.executor import Image, RouterLoss, images_from
from forkrl.core.train import AliasReplica, HostDefaults, ParallelContext, StepInputs, StepLoss, router_value

from . import compat
from .balance import balance_window

if TYPE_CHECKING:
    from .trainer import TreeTrainingMixin

__all__ = ["IMAGE_KEYS", "LeafModel", "TRLHost", "layout", "row_images", "row_types"]

#: A micro-batch as the trainer collects it: TRL's prepared inputs and ``num_items_in_batch``.
MicroBatch = tuple[dict[str, Any], Any]

# Inputs of vision-language batches; the tree takes images as IMAGE_KEYS carry them.
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
    "num_images",
    "num_tiles",
)
# Qwen-VL family, LLaVA, LLaVA-NeXT (image_sizes), Gemma 3 (token_type_ids: its images attend both ways)
IMAGE_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "mm_token_type_ids",
    "image_sizes",
    "token_type_ids",
)


def layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int) -> RowLayout:
    """TRL's ``[left-padded prompt | right-padded completion]`` with ``[B, C]`` completion tensors."""
    return RowLayout.padded(input_ids, attention_mask, int(width))


def row_images(inputs: dict, rows: int) -> list[list[Image]] | None:
    """Per row, its images, from TRL's fields for a micro-batch; None without images. The Qwen-VL
    family: ``pixel_values`` ``[patches, d]`` of all its images in order, ``image_grid_thw``
    ``[images, 3]``; LLaVA: ``pixel_values`` ``[images, C, H, W]``; LLaVA-NeXT: ``pixel_values``
    ``[images, crops, C, H, W]`` and ``image_sizes`` ``[images, 2]``; ``num_images`` per row."""
    pixels, grid, counts = inputs.get("pixel_values"), inputs.get("image_grid_thw"), inputs.get("num_images")
    sizes = inputs.get("image_sizes")
    if pixels is None:
        return None
    if counts is None or len(counts) != rows or (grid is None and pixels.shape[0] != sum(counts)):
        raise ValueError(
            "tree_packing needs each row's image count (num_images) and each image's pixels (with image_grid_thw "
            f"for the Qwen-VL family) for {rows} rows: turn tree_packing off for this model"
        )
    try:
        per_image = images_from(pixels, grid, sizes)
    except ValueError as err:
        raise ValueError(f"{err}: turn tree_packing off for this model") from None
    out, k = [], 0
    for n in counts:
        out.append(per_image[k : k + int(n)])
        k += int(n)
    return out


def row_types(inputs: dict, attention_mask: torch.Tensor) -> list[torch.Tensor] | None:
    """Per row, ``mm_token_type_ids`` over its real tokens (TRL's are ``[B, T]`` like the ids, zeros
    over the completion; a generated placeholder id is text), or None when TRL passes none."""
    types = inputs.get("mm_token_type_ids")
    if types is None:
        return None
    return [t[m.bool()].cpu() for t, m in zip(types, attention_mask, strict=True)]


class LeafModel:
    """Stands in for the model inside TRL's loss during a tree step: it carries one micro-batch's
    leaves, which the trainer's ``_get_per_token_logps_and_entropies`` returns when handed it
    (TRL's loss passes its ``model`` argument straight there); every attribute is the model's.

    Args:
        model: the model TRL's ``training_step`` received.
        logps: ``[B, C]`` the tree's log-probs (leaves), ``entropies`` ``[B, C]`` or None, and
            ``aux`` the router loss's value (a scalar).
    """

    def __init__(
        self, model: Any, logps: torch.Tensor, entropies: torch.Tensor | None, aux: torch.Tensor
    ) -> None:
        self.model, self.logps, self.entropies, self.aux = model, logps, entropies, aux

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "tree step: the loss called the model directly; inside a tree step TRL's loss reads log-probs through "
            "_get_per_token_logps_and_entropies: turn tree_packing off for a loss that runs its own forward"
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def context_parallel_group(size: int) -> Any:
    """This process's group of ``size`` consecutive processes (every process builds every group, as
    ``new_group`` requires), or None for ``size`` 1.

    Raises:
        ValueError: when ``size`` does not divide the number of processes.
    """
    if size == 1:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % size:
        raise ValueError(
            f"long_context_cp_size={size} must divide the number of processes ({world}): launch a multiple of "
            f"{size} processes (accelerate launch --num_processes), or change long_context_cp_size"
        )
    groups = [dist.new_group(list(range(first, first + size))) for first in range(0, world, size)]
    return groups[dist.get_rank() // size]


class TRLHost(HostDefaults[MicroBatch]):
    """A TRL trainer's :class:`~forkrl.core.train.HostAdapter` (module docstring); the
    :class:`~forkrl.core.train.HostDefaults` it inherits answer :meth:`balancing`.

    Attributes:
        window: the optimizer step's prepared micro-batches collected so far.
        model: the model the window's ``training_step`` calls received (handed to TRL's loss).
        balance: rows move between the ranks (decided once at setup: ``tree_balance``).
        engine: DeepSpeed trains the model (the step's gradient is handed to its engine).
        context_parallel: with ``long_context_cp_size`` C > 1, this process's group of C
            consecutive processes, which split long prompts and train their rows' union
            (:class:`~forkrl.core.train.GroupRows`); None otherwise.
    """

    def __init__(self, trainer: TreeTrainingMixin) -> None:
        self.trainer = trainer
        self.window: list[MicroBatch] = []
        self.model: Any = None
        self.engine = bool(getattr(trainer, "is_deepspeed_enabled", False))
        self.context_parallel = context_parallel_group(trainer.args.long_context_cp_size)

    def parallel(self) -> ParallelContext:
        several = self.trainer.accelerator.num_processes > 1
        return ParallelContext(
            self.trainer.accelerator.device,
            average_gradients=several and not self.engine,  # DDP: the tree runs on the unwrapped module
            lockstep=several and self.engine,  # the engine reduces after the step
            context_parallel=self.context_parallel,
            context_parallel_rows="own",  # each process its own rollouts
        )

    def rebalance(self, window: Sequence[MicroBatch], cost: CostModel) -> tuple[list[MicroBatch], Rebalanced]:
        device = window[0][0]["completion_ids"].device
        return balance_window(list(window), self.trainer._tokenizer.pad_token_id or 0, device, cost)

    def inputs(self, window: Sequence[MicroBatch]) -> StepInputs:
        layouts, images, types = [], [], []
        for inputs, _ in window:
            present = [k for k in _MULTIMODAL_KEYS if k not in IMAGE_KEYS and inputs.get(k) is not None]
            if present:
                raise ValueError(
                    "tree_packing takes images as the Qwen-VL, LLaVA(-NeXT) and Gemma 3 processors give them "
                    "(pixel_values, image_grid_thw, image_sizes, token_type_ids) but "
                    f"the batch carries {present}: turn tree_packing off"
                )
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            layouts.append(layout(input_ids, attention_mask, inputs["completion_ids"].shape[1]))
            images.extend(row_images(inputs, input_ids.shape[0]) or [[] for _ in range(input_ids.shape[0])])
            types.append(row_types(inputs, attention_mask))
        # the processor's token types where every micro-batch has them, else placeholders by id
        token_types = [t for part in types for t in part] if None not in types else None
        return StepInputs(layouts, images, token_types)

    def router_weights(self, window: Sequence[MicroBatch]) -> list[float] | None:
        trainer = self.trainer
        return [trainer._router_weight(n) for _, n in window] if trainer.aux_loss_enabled else None

    def loss(self, window: Sequence[MicroBatch], router: RouterLoss | None) -> StepLoss:
        trainer, model = self.trainer, self.model
        sync = trainer.accelerator.gradient_state.sync_gradients

        def loss_fn(i: int, logps: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
            inputs, num_items = window[i]
            leaves = LeafModel(model, logps, entropies, router_value(router, i, logps.device))
            # TRL's loss does its once-per-optimizer-step work (adaptive entropy) on the last micro-batch.
            with (
                compat.sync_gradients(trainer, sync and i == len(window) - 1),
                trainer.compute_loss_context_manager(),
            ):
                loss = trainer.compute_loss(leaves, inputs, num_items_in_batch=num_items)
            return trainer._scale_like_training_step(loss, num_items)

        gradient = "constant" if trainer._coefficients_constant(window) else "general"
        return StepLoss(loss_fn, gradient, entropy=True, quiet=trainer._quiet)

    def context(self) -> AbstractContextManager:
        return self.trainer.accelerator.autocast()

    def hand_over(self, replica: AliasReplica) -> None:
        """accelerate's DeepSpeed ``backward``, split: the engine's backward while the parameters are
        whole (ZeRO-3), as the window's last micro-batch (the accumulation boundary; the earlier ones
        ran no backward, so DeepSpeed reduces once per optimizer step); its step comes after the
        partitions are released (:meth:`step_engine`). transformers' ``training_step`` turns off
        DeepSpeed's own scaling by the accumulation steps."""
        engine = compat.deepspeed_engine(self.trainer)
        engine.set_gradient_accumulation_boundary(is_boundary=self.trainer.accelerator.sync_gradients)
        engine.backward(replica.gradient_surrogate(), scale_wrt_gas=False)

    def step_engine(self) -> None:
        """The engine's optimizer step at the accumulation boundary (after :meth:`hand_over`)."""
        if self.engine and self.trainer.accelerator.sync_gradients:
            compat.deepspeed_engine(self.trainer).step()

    def log(self, metrics: dict[str, float]) -> None:
        sink = compat.metrics(self.trainer, "train")
        for key, value in metrics.items():
            sink[key].append(value)
