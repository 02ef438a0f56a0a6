"""Which of a transformers model's parameters are tied copies of another (``_tied_weights_keys``)."""

from __future__ import annotations

from torch import nn

from .registry import CHECKED, Private


def tied_weight_names(model: nn.Module) -> set[str]:
    """The names of ``model``'s parameters that are tied copies of another one (transformers 5:
    the class's ``_tied_weights_keys``, ``{copy: source}``; None without tied weights), which a
    full state dict of the model need not hold. Read without a default: every ``PreTrainedModel``
    declares it, so a rename fails here and in the contract test, not as a sync refused for a
    missing copy."""
    return set(model._tied_weights_keys or ())


def _check_tied_weights_keys() -> None:
    from transformers import LlamaForCausalLM, PreTrainedModel

    assert "_tied_weights_keys" in vars(PreTrainedModel), "PreTrainedModel declares no _tied_weights_keys"
    keys = LlamaForCausalLM._tied_weights_keys
    assert "lm_head.weight" in set(keys or ()), f"LlamaForCausalLM._tied_weights_keys = {keys!r}"


#: This area's entries (checked by ``tests/core/test_compat.py``).
PRIVATES: tuple[Private, ...] = (
    Private(
        "transformers",
        "PreTrainedModel._tied_weights_keys (a model class's tied copies, {copy: source} from 5.0)",
        "a full-weight sync into a rollout model (veRL's CPU rollout) accepts a state dict without the tied "
        "copies (lm_head.weight under tie_word_embeddings), which load_state_dict reports missing",
        _check_tied_weights_keys,
        CHECKED,
    ),
)
