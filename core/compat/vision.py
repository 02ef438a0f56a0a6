"""transformers' vision-language modelling internals the tree's image path reads
(:mod:`forkrl.core.executor.vision`): the towers' attribute names, Qwen's multimodal RoPE, LLaVA-NeXT's
crop count and Gemma 3's image-block masks."""

from __future__ import annotations

import importlib
import inspect

import torch
from torch import nn

from .registry import CHECKED, Private, parameter_names

__all__ = ["gemma3_vision_masks", "llava_next_crops", "rope_index", "vision_tower"]

#: (module, class) of the models whose multimodal RoPE positions the tree takes from ``get_rope_index``.
_MROPE_MODELS = (
    ("qwen2_vl", "Qwen2VLModel"),
    ("qwen2_5_vl", "Qwen2_5_VLModel"),
    ("qwen3_vl", "Qwen3VLModel"),
)
_ROPE_ARGS = ["self", "input_ids", "mm_token_type_ids", "image_grid_thw"]


def _model_class(module: str, name: str) -> type:
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)


def _check_towers() -> None:
    for module, name in _MROPE_MODELS:
        assert "self.visual =" in inspect.getsource(_model_class(module, name).__init__), f"{name}.visual"
    for module, name in (
        ("llava", "LlavaModel"),
        ("llava_next", "LlavaNextModel"),
        ("gemma3", "Gemma3Model"),
    ):
        init = inspect.getsource(_model_class(module, name).__init__)
        for attr in ("self.vision_tower =", "self.multi_modal_projector ="):
            assert attr in init, f"{name}: {attr}"
    assert "self.image_newline =" in inspect.getsource(_model_class("llava_next", "LlavaNextModel").__init__)


def vision_tower(inner: nn.Module) -> nn.Module:
    """The vision tower and its projector of a vision-language model's inner model (their parameters
    train or not together): Qwen's ``visual``, else LLaVA's and Gemma 3's tower and projector."""
    if hasattr(inner, "visual"):
        return inner.visual
    return nn.ModuleList([inner.vision_tower, inner.multi_modal_projector])


def _check_rope_index() -> None:
    for module, name in _MROPE_MODELS:
        found = parameter_names(_model_class(module, name).get_rope_index)
        assert found[: len(_ROPE_ARGS)] == _ROPE_ARGS, f"{name}.get_rope_index{tuple(found)}"


def rope_index(
    inner: nn.Module, ids: torch.Tensor, kinds: torch.Tensor, grid_thw: torch.Tensor
) -> torch.Tensor:
    """``[3, B, T]``: the model's own multimodal RoPE position ids of ``ids`` ``[B, T]`` (token types
    ``kinds`` ``[B, T]``, images' grids ``grid_thw`` ``[n, 3]``)."""
    pos, _ = inner.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grid_thw)
    return pos


def _check_crops() -> None:
    from transformers.models.llava_next import modeling_llava_next

    found = parameter_names(modeling_llava_next.image_size_to_num_patches)
    assert found == ["image_size", "grid_pinpoints", "patch_size"], found


def llava_next_crops(image_size: torch.Tensor, grid_pinpoints, patch_size: int) -> int:
    """How many crops LLaVA-NeXT makes of an image of ``image_size`` (its base crop included)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    return image_size_to_num_patches(
        image_size=image_size, grid_pinpoints=grid_pinpoints, patch_size=patch_size
    )


def _check_gemma3_masks() -> None:
    from transformers.models.gemma3 import modeling_gemma3

    found = parameter_names(modeling_gemma3.create_masks_for_vision_model)
    want = ["config", "inputs_embeds", "attention_mask", "cache", "position_ids", "block_sequence_ids"]
    assert found[: len(want)] == want, found


def gemma3_vision_masks(**kwargs):
    """Gemma 3's own attention masks with each run of image tokens one both-way block
    (``create_masks_for_vision_model``; ``block_sequence_ids`` ``[B, T]``: the block per token, -1 for text)."""
    from transformers.models.gemma3.modeling_gemma3 import create_masks_for_vision_model

    return create_masks_for_vision_model(**kwargs)


PRIVATES: tuple[Private, ...] = (
    Private(
        "transformers",
        "Qwen2VLModel/Qwen2_5_VLModel/Qwen3VLModel.visual; LlavaModel/LlavaNextModel/Gemma3Model.vision_tower, "
        "multi_modal_projector; LlavaNextModel.image_newline",
        "the tree runs each unique image through the vision tower once and backpropagates the tower once; "
        "LLaVA-NeXT's row separator is part of its image rows",
        _check_towers,
        CHECKED,
    ),
    Private(
        "transformers",
        "Qwen2VLModel/Qwen2_5_VLModel/Qwen3VLModel.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw)",
        "each sequence's [3, T] multimodal RoPE positions come from the model's own function; a node takes its span",
        _check_rope_index,
        CHECKED,
    ),
    Private(
        "transformers",
        "transformers.models.llava_next.modeling_llava_next.image_size_to_num_patches",
        "a LLaVA-NeXT image in a padded batch keeps only its own crops (the count the model computes)",
        _check_crops,
        CHECKED,
    ),
    Private(
        "transformers",
        "transformers.models.gemma3.modeling_gemma3.create_masks_for_vision_model(..., block_sequence_ids)",
        "Gemma 3 attends both ways within an image: a unit holding image tokens gets the model's own masks",
        _check_gemma3_masks,
        CHECKED,
    ),
)
