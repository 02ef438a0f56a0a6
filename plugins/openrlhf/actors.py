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
        if tree is None or action_mask is None:
            return super().forward(
                sequences, action_mask, attention_mask, packed_seq_lens, mm_train_inputs_list
            )
        return _score(tree, self.actor, sequences, action_mask, attention_mask, mm_train_inputs_list)


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
        if tree is None or return_output or action_mask is None:
            return super().forward(
                sequences, action_mask, attention_mask, return_output, packed_seq_lens, mm_train_inputs_list
            )
        return _score(tree, self.model, sequences, action_mask, attention_mask, mm_train_inputs_list)


def _score(
    tree: TreeStep, actor: Any, sequences, action_mask, attention_mask, mm_train_inputs_list: Any
) -> torch.Tensor:
    """:func:`score_log_probs` of the rows as Ray delivered them (planned on the host), for both actors;
    with a vision-language ``actor`` (OpenRLHF's ``Actor``) each row's images, else none, as OpenRLHF's
    actors ignore the field for a text model (by content: it passes ``[[None], ...]`` for text samples too)."""
    vlm = getattr(actor, "is_vlm", False)
    images = row_images(mm_train_inputs_list, sequences.shape[0]) if vlm else None
    return score_log_probs(tree, tree_module(actor), sequences, action_mask, attention_mask, images=images)


# Ray actor classes, built as OpenRLHF builds its own (one GPU per actor by default).
PolicyModelActor = ray.remote(num_gpus=1)(TreePolicyModelActor)
ReferenceModelActor = ray.remote(num_gpus=1)(TreeReferenceModelActor)
