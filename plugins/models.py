"""A model name a host would load, checked before the host spends anything on it.

Hosts hand a model name to ``from_pretrained``, which reads a path that does not exist as a hub id
and fails with Hugging Face's repo-id rule ("Repo id must be in the form ..."), and only after the
host has started its processes (OpenRLHF: Ray and its actors). A name that can be neither is
refused first, by the plugin that knows which flag named it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["missing_model", "no_such_model"]


def missing_model(name: str) -> bool:
    """Whether ``name`` is a local path that does not exist: not a folder or file here, and not a
    hub id either (absolute, relative with ``.``/``~``, or more than ``namespace/name``), so that
    loading it could only fail."""
    if Path(name).expanduser().exists():
        return False
    if name.startswith(("/", ".", "~")) or "\\" in name:
        return True
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def no_such_model(option: str, name: str) -> str:
    """The message for a model ``option`` (as the user wrote it) whose value ``name`` is missing."""
    return (
        f"{option} {name!r}: no such model folder or hub id (the path does not exist here, and a Hugging Face hub "
        "id is 'name' or 'namespace/name'): pass the folder that holds the model's config.json, or a hub id"
    )
