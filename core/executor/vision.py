"""Images in a tree: each unique image through the vision tower once, its rows a shared prefix's input.

A vision-language model's prompt holds an image as a run of placeholder tokens whose input
embeddings the model replaces by the vision tower's output rows. Every response of a group shares
the image, so the tree computes the vision tower once per unique image and the image's rows once
per shared prefix. :class:`VisionBatch` prepares one batch:

1. **Unique images.** Images are keyed by their pixels and grid; each unique image runs through the
   model's own ``get_image_features`` once (``[rows_j, hidden]``), with grad when the vision tower
   trains. The rows of all images form one tensor ``F`` ``[rows, hidden]``; the tree reads a detached
   leaf of it, whose gradient accumulates from every unit that reads a row, and :meth:`finish` runs
   the vision tower's backward once with that gradient (a frozen tower: no graph, no backward).
2. **Virtual token ids.** In the sequences the forest is built from, the ``k``-th placeholder of an
   image whose rows start at ``r`` in ``F`` becomes ``vocab + r + k``: two prompts of equal text and
   different images differ there (so they do not share a prefix past it), the same image in two
   prompts gives equal ids (they do). A unit's input embedding is the model's token embedding for
   real ids and ``F[id - vocab]`` for virtual ones (what the model's ``masked_scatter`` puts there).
3. **Positions as the model computes them.** Qwen2-VL's and Qwen2.5-VL's multimodal RoPE gives each
   token three position ids from the image grid (:meth:`get_rope_index`), and the text after an
   image continues from the grid's largest, not from its depth. Each sequence's ``[3, T]`` positions
   are computed once by the model's own function; a unit takes its node's span from a sequence
   through that node (all such sequences have the same prefix, so the same positions there).

4. **Deepstack** (Qwen3-VL): the vision tower's intermediate features are added to the image
   tokens' hidden states inside the first decoder layers. They are leaves like the rows (one per
   such layer) and reach the decoder as its ``visual_pos_masks``/``deepstack_visual_embeds`` for the
   unit's image tokens; their gradient joins the rows' in the tower's one backward.

LLaVA and LLaVA-NeXT (image features spliced into the text embeddings, positions by depth) take
the same path with plain positions; LLaVA-NeXT's features per image are its crops' packed rows
(``image_newline`` included), as its ``get_image_features`` makes them.

5. **Both-way attention within an image** (Gemma 3): a unit holding image tokens gets the model's
   own masks (``create_masks_for_vision_model``) with each run of image tokens one block. An image
   never spans two forest nodes; a replay block that would cut one is refused.

Supported: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and Qwen3.5-MoE (images; M-RoPE), LLaVA,
LLaVA-NeXT and Gemma 3, in keep and replay modes. Refused with :class:`UnsupportedModelError`:
video, packed mode, and other vision-language models (e.g. Gemma 4, SmolVLM, InternVL).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import compat
from ..errors import UnsupportedModelError

__all__ = ["IMAGE_KEYS", "VIDEO_KEYS", "Image", "VisionBatch", "images_from", "processor_images"]

#: Supported models and how their images enter: "mrope" (patches and a grid per image, multimodal
#: RoPE from get_rope_index), "plain" (LLaVA: one ``[C, H, W]`` image, positions by depth), "anyres"
#: (LLaVA-NeXT: ``[crops, C, H, W]`` and the image's size, positions by depth), "gemma3" (one
#: ``[C, H, W]`` image, positions by depth, an image's tokens attending to each other both ways).
_FAMILIES = {
    "Qwen2VLForConditionalGeneration": "mrope",
    "Qwen2_5_VLForConditionalGeneration": "mrope",
    "Qwen3VLForConditionalGeneration": "mrope",
    "Qwen3_5ForConditionalGeneration": "mrope",
    "Qwen3_5MoeForConditionalGeneration": "mrope",
    "LlavaForConditionalGeneration": "plain",
    "LlavaNextForConditionalGeneration": "anyres",
    "Gemma3ForConditionalGeneration": "gemma3",
}
_SUPPORTED = tuple(_FAMILIES)


@dataclass
class Image:
    """One image as the model's processor gives it.

    Attributes:
        pixel_values: ``[patches, channels * temporal_patch * patch * patch]`` (the Qwen-VL family),
            ``[channels, height, width]`` (LLaVA), or ``[crops, channels, height, width]``
            (LLaVA-NeXT; crops past the image's own count, a batch's padding, are dropped).
        grid_thw: ``[3]`` the patch grid (temporal, height, width); None for LLaVA.
        image_size: ``[2]`` the original height and width (LLaVA-NeXT), else None.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor | None = None
    image_size: torch.Tensor | None = None

    def key(self) -> str:
        """Equal for equal pixels and grid (computed once per object)."""
        cached = self.__dict__.get("_key")
        if cached is not None:
            return cached
        pixels = self.pixel_values.detach().contiguous().cpu()
        digest = hashlib.sha1(pixels.view(torch.uint8).numpy().tobytes())
        grid = None if self.grid_thw is None else self.grid_thw.tolist()
        size = None if self.image_size is None else self.image_size.tolist()
        digest.update(str((tuple(pixels.shape), str(pixels.dtype), grid, size)).encode())
        self.__dict__["_key"] = digest.hexdigest()
        return self.__dict__["_key"]


def images_from(
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    image_sizes: torch.Tensor | None = None,
) -> list[Image]:
    """Images, in order, from a processor's outputs (for one row, or for a batch's rows in order).

    Args:
        pixel_values: the Qwen-VL family's ``[patches, d]`` (all images' patches, one after another),
            LLaVA's and Gemma 3's ``[images, C, H, W]``, or LLaVA-NeXT's ``[images, crops, C, H, W]``.
        image_grid_thw: ``[images, 3]`` (the Qwen-VL family): image ``j`` has ``prod(grid_j)`` patches.
        image_sizes: ``[images, 2]`` (LLaVA-NeXT): each image's original height and width.

    Raises:
        ValueError: when the grids do not add up to the patches.
    """
    pixels = torch.as_tensor(pixel_values)
    if image_grid_thw is not None:
        grid = torch.as_tensor(image_grid_thw).reshape(-1, 3)
        counts = grid.prod(-1).tolist()
        if sum(counts) != pixels.shape[0]:
            raise ValueError(
                f"image_grid_thw {grid.tolist()} makes {sum(counts)} patches but pixel_values has {pixels.shape[0]}"
            )
        return [Image(p, g) for p, g in zip(torch.split(pixels, counts), grid, strict=True)]
    if image_sizes is not None:
        sizes = torch.as_tensor(image_sizes).reshape(-1, 2)
        return [Image(p, image_size=s) for p, s in zip(pixels, sizes, strict=True)]
    return [Image(p) for p in pixels]


#: A row's processor outputs that carry its images: the Qwen-VL family's ``pixel_values`` and
#: ``image_grid_thw``, LLaVA's and Gemma 3's ``pixel_values``, LLaVA-NeXT's with ``image_sizes``.
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_sizes")
#: The Qwen-VL processors' video outputs (any other key naming video is taken as video too).
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "video_second_per_grid")


def processor_images(
    outputs: Mapping[str, Any] | None, row: str, field: str, way_out: str, ignored: Collection[str] = ()
) -> list[Image]:
    """One row's images from its processor outputs (``{}`` or None: a text row, no images).

    Args:
        outputs: the row's processor outputs, :data:`IMAGE_KEYS` (as :func:`images_from` takes
            them); a key whose value is None is absent.
        row: the row as refusals name it (``"row 3"``); ``field`` the host's name of ``outputs``.
        way_out: what a refusal offers instead, in the host's words.
        ignored: further keys the host writes beside the images and no model reads.

    Raises:
        UnsupportedModelError: for video (:data:`VIDEO_KEYS`, or any key naming video) and for
            outputs the tree does not know how to place.
        ValueError: when the grids do not add up to the patches.
    """
    present = {k for k, v in (outputs or {}).items() if v is not None}
    video = sorted(k for k in present if k in VIDEO_KEYS or "video" in k)
    if video:
        raise UnsupportedModelError(
            f"{row} carries video ({', '.join(video)}): forkrl's tree takes images only; {way_out}"
        )
    unknown = sorted(present - set(IMAGE_KEYS) - set(ignored))
    if unknown or (present and "pixel_values" not in present):
        raise UnsupportedModelError(
            f"{row}'s {field} holds {sorted(present)}: forkrl's tree takes images as the Qwen-VL, LLaVA(-NeXT) "
            f"and Gemma 3 processors give them ({', '.join(IMAGE_KEYS)}); {way_out}"
        )
    if not present:
        return []
    try:
        return images_from(outputs["pixel_values"], outputs.get("image_grid_thw"), outputs.get("image_sizes"))
    except ValueError as err:
        raise ValueError(f"{row}: {err}; {way_out}") from None


class VisionBatch:
    """A batch's images for tree passes of one vision-language model (module docstring).

    Build it with :meth:`prepare`, build the forest from :attr:`sequences`, and give it to
    :meth:`TreeExecutor.score` / :meth:`TreeExecutor.backward`; after a gradient pass,
    :meth:`finish` (the executor calls it) backpropagates the image rows' gradient through the
    vision tower once.

    Attributes:
        sequences: ``[T_i]`` token ids per sequence, image placeholders replaced by virtual ids.
        positions: the model's position ids per sequence: ``[3, T_i]`` (multimodal RoPE) or ``[T_i]``.
        vocab: the first virtual id (the model's vocabulary size).
        unique_images: how many distinct images the batch holds (vision tower forwards).
    """

    def __init__(
        self,
        sequences: list[torch.Tensor],
        positions: list[torch.Tensor],
        vocab: int,
        rows: torch.Tensor,
        graph: torch.Tensor | None,
        unique_images: int,
        deep_rows: list[torch.Tensor] | None = None,
        deep_graph: list[torch.Tensor] | None = None,
        bidirectional: bool = False,
    ) -> None:
        self.sequences, self.positions, self.vocab = sequences, positions, vocab
        self.rows = rows  # [rows, hidden]: the leaf the tree reads (requires grad when training)
        self._graph = graph  # the same rows in the vision tower's graph, or None
        # Qwen3-VL's deepstack: per decoder layer it feeds, [rows, hidden] added to the image rows' states
        self.deep_rows = deep_rows or []
        self._deep_graph = deep_graph or []
        self.unique_images = unique_images
        self._through: list[int] | None = None
        self.bidirectional = bidirectional  # Gemma 3: an image's tokens attend to each other both ways

    # ------------------------------------------------------------------ building
    @classmethod
    def prepare(
        cls,
        model: nn.Module,
        sequences: Sequence[torch.Tensor | Sequence[int]],
        images: Sequence[Sequence[Image]],
        grad: bool = True,
        token_types: Sequence[torch.Tensor] | None = None,
    ) -> VisionBatch:
        """Run each unique image through the vision tower and rewrite the sequences.

        Args:
            model: a supported vision-language model (``*ForConditionalGeneration``).
            sequences: ``[T_i]`` token ids per sequence, as the model's processor makes them (each
                image a run of the model's ``image_token_id``).
            images: per sequence, its images in the order they appear.
            grad: whether a gradient pass follows (the vision tower's graph is kept when it trains).
            token_types: per sequence, ``[T_i]`` the processor's ``mm_token_type_ids`` (0 text, 1
                image, 2 video; a host extends them with 0 over the completion): which tokens are
                placeholders (the Qwen-VL family; LLaVA's forward goes by the ids). Without them every ``image_token_id`` is one and a ``video_token_id``
                is refused; with them a generated token equal to either is text, as the model's
                forward treats it.

        Raises:
            UnsupportedModelError: for a model this module does not support.
            ValueError: when a sequence's placeholders do not match its images' sizes.
        """
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        check_model(base)
        config = base.config
        vocab = int(base.get_input_embeddings().weight.shape[0])
        seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1).cpu() for s in sequences]
        if len(images) != len(seqs):
            raise ValueError(f"{len(seqs)} sequences but images for {len(images)}")
        kind = _FAMILIES[type(base).__name__]
        if kind == "anyres":
            images = [[_crops(config, img) for img in imgs] for imgs in images]
        # LLaVA's forward finds its placeholders by id, whatever token types a host passes
        types = _types(config, seqs, token_types if kind == "mrope" else None)
        if kind == "mrope":  # before the tower runs: the grid says how many rows each image makes
            _check_placeholders(types, images, lambda img: int(img.grid_thw.prod()) // _merge(config))
        unique: dict[str, int] = {}
        ordered: list[Image] = []
        for img in (img for imgs in images for img in imgs):
            if unique.setdefault(img.key(), len(ordered)) == len(ordered):
                ordered.append(img)
        newline = getattr(getattr(base, "model", base), "image_newline", None)  # LLaVA-NeXT's row separator
        tower = [*_vision_tower(base).parameters(), *([newline] if newline is not None else [])]
        trains = grad and any(p.requires_grad for p in tower)
        per_image, deep = _features(base, ordered, trains, kind)
        rows_of = {img.key(): feats.shape[0] for img, feats in zip(ordered, per_image, strict=True)}
        _check_placeholders(types, images, lambda img: rows_of[img.key()])
        graph = torch.cat(per_image) if per_image else base.get_input_embeddings().weight[:0]
        deep_graph = [torch.cat(layer) for layer in deep]
        starts = [0]
        for feats in per_image:
            starts.append(starts[-1] + feats.shape[0])
        tree_seqs = []
        for seq, kinds, imgs in zip(seqs, types, images, strict=True):
            tree, where, k = seq.clone(), (kinds == 1).nonzero().flatten(), 0
            for img in imgs:
                j = unique[img.key()]
                n = per_image[j].shape[0]
                tree[where[k : k + n]] = vocab + starts[j] + torch.arange(n)
                k += n
            tree_seqs.append(tree)
        positions = [
            _positions(base, s, t, imgs).cpu() if kind == "mrope" else torch.arange(len(s))
            for s, t, imgs in zip(seqs, types, images, strict=True)
        ]
        rows = graph.detach().requires_grad_(trains)
        deep_rows = [g.detach().requires_grad_(trains) for g in deep_graph]
        return cls(
            tree_seqs, positions, vocab, rows, graph if trains else None, len(ordered),
            deep_rows, deep_graph if trains else None, bidirectional=kind == "gemma3",
        )  # fmt: skip

    # ------------------------------------------------------------------ in a pass
    def check(self, forest, mode: str) -> None:
        """Raise before a pass when ``forest`` is not this batch's or the mode cannot take images."""
        if mode == "packed":
            raise UnsupportedModelError(
                "images on a tree run in keep or replay mode (the packed tree mask takes token ids): use "
                "mode='keep' or 'replay'"
            )
        if forest.num_sequences != len(self.sequences) or any(
            not torch.equal(forest.sequence_tokens(i), s) for i, s in enumerate(self.sequences)
        ):
            raise ValueError(
                "the forest was not built from this VisionBatch's sequences: build it from .sequences"
            )

    def bind(self, forest) -> None:
        """Remember, per forest node, one sequence through it (whose positions the node takes)."""
        through = [-1] * len(forest.nodes)
        for node in reversed(forest.nodes):  # children come after their parents
            if node.owners:
                through[node.index] = node.owners[0]
            elif node.children:
                through[node.index] = through[node.children[0]]
        self._through = through

    def inputs(
        self, embed: nn.Module, ids: torch.Tensor, start: int, nodes: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """A unit's (or a batch of sibling leaves') input embeddings, position ids and further
        decoder arguments (Qwen3-VL's deepstack rows for the unit's image tokens).

        Args:
            embed: the model's token embedding.
            ids: ``[B, n]`` tree token ids (real or virtual; right padding with 0 after a short row).
            start: the absolute position of column 0.
            nodes: per row, the forest node it belongs to.

        Returns:
            ``([B, n, hidden] inputs_embeds, [3, B, n] or [B, n] position_ids, kwargs)``; with deepstack,
            ``kwargs`` holds ``visual_pos_masks`` ``[B, n]`` and ``deepstack_visual_embeds`` (per
            layer ``[image tokens, hidden]``, in the mask's row-major order).
        """
        if self._through is None:
            raise RuntimeError("internal: VisionBatch.bind(forest) was not called before the pass")
        virtual = ids >= self.vocab
        embeds = embed(torch.where(virtual, torch.zeros_like(ids), ids))
        if bool(virtual.any()):
            rows = self.rows.to(embeds.device, embeds.dtype)[(ids - self.vocab).clamp(min=0)]
            embeds = torch.where(virtual[..., None], rows, embeds)
        n = ids.shape[1]
        pos = []
        for node in nodes:
            full = self.positions[self._through[node]]  # [3, T] (multimodal RoPE) or [T]
            span = full[..., start : start + n]
            if span.shape[-1] < n:  # the padding after a short leaf: positions past its end
                extra = span[..., -1:] + torch.arange(1, n - span.shape[-1] + 1)
                span = torch.cat([span, extra], dim=-1)
            pos.append(span)
        extra = {}
        if self.deep_rows and bool(virtual.any()):
            index = (ids - self.vocab)[virtual]
            extra = {
                "visual_pos_masks": virtual,
                "deepstack_visual_embeds": [d.to(embeds.device, embeds.dtype)[index] for d in self.deep_rows],
            }
        return embeds, torch.stack(pos, dim=-2).to(ids.device), extra

    def attention(self, base: nn.Module, embeds: torch.Tensor, positions: torch.Tensor, cache, ids: torch.Tensor,
                  start: int, nodes: Sequence[int]) -> dict | None:  # fmt: skip
        """Gemma 3's masks for a unit holding image tokens (else None: the decoder's own causal masks).

        The model's own ``create_masks_for_vision_model`` over the ancestors' cache, with each run of
        image tokens one block that attends to itself both ways (positions before ``start`` are in
        the cache, never in a block: an image never spans two forest nodes, whose ids differ from
        the image's first token). A unit that splits an image (a replay block boundary inside it)
        is refused: its later tokens' keys are not there yet.

        Args:
            base: the model (``*ForConditionalGeneration``).
            embeds: ``[B, n, hidden]`` the unit's input embeddings.
            positions: ``[B, n]`` its position ids.
            cache: the ancestors' cache the decoder runs over.
            ids: ``[B, n]`` tree token ids; ``start``: the absolute position of column 0.
            nodes: per row, its forest node.

        Returns:
            ``{"full_attention": mask, "sliding_attention": mask}`` or None.
        """
        virtual = ids >= self.vocab
        if not self.bidirectional or not bool(virtual.any()):
            return None
        for node in nodes:
            seq = self.sequences[self._through[node]]
            for k in (start, start + ids.shape[1]):
                if 0 < k < len(seq) and bool(seq[k - 1] >= self.vocab) and bool(seq[k] >= self.vocab):
                    raise UnsupportedModelError(
                        "Gemma 3 attends both ways within an image, and this pass cuts an image into two blocks: "
                        "use mode='keep', or a replay block size of at least the image's tokens"
                    )
        starts = virtual & ~torch.nn.functional.pad(virtual, (1, 0), value=False)[:, :-1]
        blocks = torch.where(virtual, torch.cumsum(starts.long(), dim=1) - 1, -1)
        past = torch.full((ids.shape[0], start), -1, dtype=blocks.dtype, device=blocks.device)
        return compat.gemma3_vision_masks(
            config=base.config.get_text_config(), inputs_embeds=embeds, attention_mask=None, cache=cache,
            position_ids=positions, block_sequence_ids=torch.cat([past, blocks], dim=1),
        )  # fmt: skip

    def finish(self) -> None:
        """After a gradient pass: the image rows' accumulated gradient through the vision tower, once."""
        outputs, grads = [], []
        for graph, leaf in zip([self._graph, *self._deep_graph], [self.rows, *self.deep_rows], strict=False):
            if graph is not None and leaf.grad is not None:
                outputs.append(graph)
                grads.append(leaf.grad.to(graph.dtype))
        if outputs:
            torch.autograd.backward(outputs, grads)
        self._graph, self._deep_graph = None, []


def check_model(base: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` unless ``base`` is a vision-language model this module serves."""
    name = type(base).__name__
    if name not in _SUPPORTED:
        raise UnsupportedModelError(
            f"{name}: forkrl's tree takes images for {', '.join(_SUPPORTED)} (image rows at the decoder's input, "
            "multimodal RoPE); train this model without tree_packing"
        )


def _types(config, seqs: list[torch.Tensor], given: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    """Per sequence ``[T_i]`` token types (0 text, 1 image, 2 video): the given ones, or from the ids."""
    if given is not None:
        if len(given) != len(seqs):
            raise ValueError(f"{len(seqs)} sequences but token types for {len(given)}")
        out = [torch.as_tensor(t).reshape(-1).long().cpu() for t in given]
        for i, (t, s) in enumerate(zip(out, seqs, strict=True)):
            if t.shape != s.shape:
                raise ValueError(f"sequence {i}: {len(s)} tokens but {len(t)} token types")
        return out
    image_token, video_token = int(config.image_token_id), getattr(config, "video_token_id", None)
    out = []
    for s in seqs:
        kinds = (s == image_token).long()
        if video_token is not None:
            kinds = kinds + 2 * (s == int(video_token)).long()
        out.append(kinds)
    return out


def _merge(config) -> int:
    return int(config.vision_config.spatial_merge_size) ** 2


def _check_placeholders(types: list[torch.Tensor], images: Sequence[Sequence[Image]], rows) -> None:
    """Each sequence's image placeholders match its images' row counts (``rows(image)``); no video."""
    for i, (kinds, imgs) in enumerate(zip(types, images, strict=True)):
        if bool((kinds == 2).any()):
            raise UnsupportedModelError(
                f"sequence {i} holds video tokens: forkrl's tree takes images only; train videos without "
                "tree_packing"
            )
        want = sum(rows(img) for img in imgs)
        have = int((kinds == 1).sum())
        if want != have:
            raise ValueError(
                f"sequence {i} has {have} image placeholder tokens but its {len(imgs)} image(s) make {want} "
                "rows: pass each sequence's images in order, as the processor made them"
            )


def _features(base: nn.Module, images: list[Image], grad: bool, kind: str) -> tuple[list, list]:
    """``[rows_j, hidden]`` per image, and per deepstack layer the same (Qwen3-VL; else none): the
    model's ``get_image_features``, all images in one call."""
    if not images:
        return [], []
    device = base.get_input_embeddings().weight.device
    with torch.set_grad_enabled(grad):
        if kind == "mrope":
            out = base.get_image_features(
                torch.cat([img.pixel_values for img in images]).to(device),
                torch.stack([img.grid_thw for img in images]).to(device),
                return_dict=True,
            )
        elif kind == "gemma3":
            out = base.get_image_features(
                torch.stack([img.pixel_values for img in images]).to(device), return_dict=True
            )
        else:  # LLaVA(-NeXT): the layer and CLS handling its forward passes from the config
            cfg = base.config
            kw = dict(vision_feature_layer=cfg.vision_feature_layer, return_dict=True,
                      vision_feature_select_strategy=cfg.vision_feature_select_strategy)  # fmt: skip
            if kind == "anyres":  # each image's crops, one after another, and its size
                kw.update(pixel_values=torch.cat([img.pixel_values for img in images]).to(device),
                          image_sizes=torch.stack([img.image_size for img in images]).to(device))  # fmt: skip
            else:
                kw.update(pixel_values=torch.stack([img.pixel_values for img in images]).to(device))
            out = base.get_image_features(**kw)
    deep = [list(layer) for layer in (getattr(out, "deepstack_features", None) or [])]
    return list(out.pooler_output), deep


def _crops(config, image: Image) -> Image:
    """A LLaVA-NeXT image with its own crops only (a batch pads every image to the most crops)."""
    if image.image_size is None or image.pixel_values.dim() != 4:
        raise ValueError("a LLaVA-NeXT image needs pixel_values [crops, C, H, W] and its image_size [2]")
    n = compat.llava_next_crops(
        image.image_size, config.image_grid_pinpoints, config.vision_config.image_size
    )
    if n > image.pixel_values.shape[0]:
        raise ValueError(f"a LLaVA-NeXT image of size {image.image_size.tolist()} needs {n} crops, got "
                         f"{image.pixel_values.shape[0]}")  # fmt: skip
    return (
        image
        if n == image.pixel_values.shape[0]
        else Image(image.pixel_values[:n], image_size=image.image_size)
    )


def _vision_tower(base: nn.Module) -> nn.Module:
    """The vision tower and its projector (their parameters train or not together)."""
    return compat.vision_tower(getattr(base, "model", base))


def _positions(
    base: nn.Module, seq: torch.Tensor, kinds: torch.Tensor, images: Sequence[Image]
) -> torch.Tensor:
    """``[3, T]``: the model's own position ids of one whole sequence."""
    device = base.get_input_embeddings().weight.device
    if not images:
        return torch.arange(len(seq)).expand(3, -1)
    ids = seq.to(device)[None]
    grid = torch.stack([img.grid_thw for img in images]).to(device)
    return compat.rope_index(base.model, ids, kinds.to(device, torch.int32)[None], grid)[:, 0]
