"""forkrl's Ray actors for OpenRLHF: the policy (tree training, tree-scored old log-probs) and the
reference model (tree-scored reference log-probs).

A vision-language model's old and reference log-probs are tree-scored with its images (each
sample's ``mm_train_inputs``: :func:`~.trainer.row_images`).

Ray pickles actor classes by reference, so these live in an importable module: every worker
imports forkrl and builds these classes, whatever the driver patched. Each subclasses OpenRLHF's
own actor class (``__ray_actor_class__``) and is wrapped with ``ray.remote`` as OpenRLHF wraps its
own. Without forkrl's options (``strategy.args.forkrl``) both behave exactly as OpenRLHF's.
"""

from __future__ import annotations

from typing import Any

import ray
import torch
from openrlhf.trainer.ray import ppo_actor
from openrlhf.trainer.ray.launcher import ReferenceModelActor as _HostReference
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor as _HostPolicy

from forkrl.core import TreeStep

from ..deepspeed import gathered
from . import compat
from .options import options_from
from .trainer import TreeActorPPOTrainer, row_images, score_log_probs, tree_module

__all__ = ["PolicyModelActor", "ReferenceModelActor", "TreePolicyModelActor", "TreeReferenceModelActor"]


class TreePolicyModelActor(_HostPolicy.__ray_actor_class__):
    """OpenRLHF's policy actor, its trainer forkrl's :class:`TreeActorPPOTrainer`."""

    def init_model_from_pretrained(self, strategy: Any, pretrain: str, *args: Any, **kwargs: Any) -> None:
        with compat.swapped(ppo_actor, ActorPPOTrainer=TreeActorPPOTrainer):
            super().init_model_from_pretrained(strategy, pretrain, *args, **kwargs)

    def forward(
        self,
        sequences: torch.LongTensor,
        action_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        packed_seq_lens=None,
        mm_train_inputs_list=None,
    ) -> torch.Tensor:
        """Old-policy action log-probs ``[B, num_actions]``: tree-scored with tree training on (with
        each row's images for a vision-language actor)."""
        tree = getattr(self.trainer, "tree_step", None)
        module = tree_module(self.actor)
        if tree is None or action_mask is None:
            return super().forward(
                sequences, action_mask, attention_mask, packed_seq_lens, mm_train_inputs_list
            )
        return score_log_probs(  # the rows as Ray delivered them: planned on the host
            tree,
            module,
            sequences,
            action_mask,
            attention_mask,
            images=_images(self.actor, mm_train_inputs_list, sequences.shape[0]),
        )


class TreeReferenceModelActor(_HostReference.__ray_actor_class__):
    """OpenRLHF's reference actor, its log-probs tree-scored with tree training on."""

    def init_model_from_pretrained(self, strategy: Any, pretrain: str, *args: Any, **kwargs: Any) -> None:
        super().init_model_from_pretrained(strategy, pretrain, *args, **kwargs)
        options = options_from(strategy.args)
        self.tree_step = (
            TreeStep(options, temperature=float(getattr(self.model, "temperature", 1.0)), gather=gathered)
            if options.tree_enabled
            else None
        )

    def forward(
        self,
        sequences: torch.LongTensor,
        action_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_output: bool = False,
        packed_seq_lens=None,
        mm_train_inputs_list=None,
    ) -> torch.Tensor:
        """Reference action log-probs ``[B, num_actions]``: tree-scored with tree training on."""
        tree = getattr(self, "tree_step", None)
        module = tree_module(self.model)
        if tree is None or return_output or action_mask is None:
            return super().forward(
                sequences, action_mask, attention_mask, return_output, packed_seq_lens, mm_train_inputs_list
            )
        return score_log_probs(  # the rows as Ray delivered them: planned on the host
            tree,
            module,
            sequences,
            action_mask,
            attention_mask,
            images=_images(self.model, mm_train_inputs_list, sequences.shape[0]),
        )


def _images(actor: Any, mm_train_inputs_list: Any, rows: int):
    """Per row, its images for a vision-language ``actor`` (OpenRLHF's ``Actor``); None otherwise,
    as OpenRLHF's actors ignore the field for a text model. By content: OpenRLHF passes
    ``mm_train_inputs_list=[[None], ...]`` for text samples too."""
    return row_images(mm_train_inputs_list, rows) if getattr(actor, "is_vlm", False) else None


# Ray actor classes, built as OpenRLHF builds its own (one GPU per actor by default).
PolicyModelActor = ray.remote(num_gpus=1)(TreePolicyModelActor)
ReferenceModelActor = ray.remote(num_gpus=1)(TreeReferenceModelActor)
