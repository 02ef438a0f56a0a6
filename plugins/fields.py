"""Whether a host's batch field holds anything: a plugin decides by a field's content, never by its
presence.

Hosts write optional fields for every row whether or not they apply: veRL's v1 agent loop writes
``multi_modal_inputs`` (an empty dict per text row), OpenRLHF's samples generator
``mm_train_inputs=[None]`` per text sample. A refusal or a fallback keyed on the field's presence
then fires on every text run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["has_content"]


def has_content(value: Any, unwrap: Callable[[Any], Any] | None = None) -> bool:
    """True when ``value`` holds something other than ``None``, empty containers and empty tensors.

    Args:
        value: a field's value (nested dicts, lists and tuples are searched).
        unwrap: turns a host's container type into plain Python first (veRL's tensordict
            ``NonTensorStack``/``NonTensorData``), returning the value unchanged otherwise.
    """
    if unwrap is not None:
        value = unwrap(value)
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        return value.numel() > 0
    if isinstance(value, dict):
        return any(has_content(v, unwrap) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(has_content(v, unwrap) for v in value)
    return True
