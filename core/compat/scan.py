"""The Mamba-1 selective scan transformers' mixers run, replaced so that a node's scan starts from
its parent's state (transformers' torch path starts every multi-token input from zero)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers.cache_utils import (
    Cache,
    LinearAttentionLayer,
)

from .cache import record_past
from .registry import CHECKED, Private, function_source, parameter_names

# Mamba-1 mixers (selective scan, one SSM state per channel; Zamba's split into heads). Their torch
# path starts every multi-token input from a zero state (a module global the mixers call) and steps
# single tokens in place; a tree pass hides the parent's state from the mixer and hands it to
# forkrl's scan instead (:mod:`forkrl.core.executor.scan`). From 5.25 Mamba, FalconMamba and Jamba
# read and store the state in a module-level ``mamba_scan_forward(mixer, ...)`` (Zamba still inline).
_SCAN_MODULES = ("mamba", "falcon_mamba", "jamba", "zamba")
_SCAN = "mamba_selective_scan"
_SCAN_ARGS = ["hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "return_last_state"]  # fmt: skip
_SCAN_MIXER_ARGS = ["self", "hidden_states", "cache", "attention_mask", "kwargs"]
_SCAN_FORWARD = "mamba_scan_forward"


def _check_scan() -> None:
    import importlib
    import re

    for name in _SCAN_MODULES:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        assert parameter_names(getattr(module, _SCAN))[: len(_SCAN_ARGS)] == _SCAN_ARGS, name
        mixers = [v for k, v in vars(module).items() if k.endswith("MambaMixer") and isinstance(v, type)]
        assert mixers, name
        for mixer in mixers:
            assert parameter_names(mixer.forward) == _SCAN_MIXER_ARGS, mixer
            src = inspect.getsource(mixer.forward)
            if hasattr(module, _SCAN_FORWARD):
                assert re.search(rf"{_SCAN_FORWARD}\(\s*self,", src), mixer
                src = function_source(module, _SCAN_FORWARD)
                assert "cache.get_recurrent_state(module.layer_idx" in src, name
                assert "cache.update_recurrent_state(last_recurrent_state, module.layer_idx)" in src, name
            else:
                assert "cache.get_recurrent_state(self.layer_idx" in src, mixer
            assert f"{_SCAN}(" in src, mixer
    if hasattr(Cache, "get_recurrent_states_to_keep"):
        layer = LinearAttentionLayer(number_of_states=1)
        record_past(layer)
        assert Cache(layers=[layer]).get_recurrent_states_to_keep(0) == 0


def scan_mixers(model: nn.Module) -> list[nn.Module]:
    """The Mamba-1 mixers of ``model`` (for :func:`scan_replaced`), in layer order."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("MambaMixer")
        and type(m).__module__.rsplit(".", 1)[-1].removeprefix("modeling_") in _SCAN_MODULES
    ]


@contextlib.contextmanager
def scan_replaced(mixers: list[nn.Module], scan: Callable, before: Callable) -> Iterator[None]:
    """For the duration, the modules of ``mixers`` (:func:`scan_mixers`) call ``scan`` for
    :data:`_SCAN`, and ``before(mixer)`` runs before each mixer's forward (a forward pre-hook)."""
    import sys

    modules = list({id(m): m for m in (sys.modules[type(x).__module__] for x in mixers)}.values())
    saved = [(m, getattr(m, _SCAN)) for m in modules]
    handles = [x.register_forward_pre_hook(lambda mixer, args: before(mixer)) for x in mixers]
    for m, _ in saved:
        setattr(m, _SCAN, scan)
    try:
        yield
    finally:
        for m, fn in saved:
            setattr(m, _SCAN, fn)
        for h in handles:
            h.remove()


def mixer_layer(mixer: nn.Module) -> int:
    """The cache layer a Mamba-1 mixer reads (its ``layer_idx``)."""
    return mixer.layer_idx


def take_recurrent_state(cache: Cache, layer_idx: int) -> torch.Tensor | None:
    """Remove and return a state layer's recurrent state (None at the start of a path): the mixer
    then sees none, so it scans even a single token (no in-place step), and stores its final state
    through ``update_recurrent_state``."""
    layer = cache.layers[layer_idx]
    state = layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None
    layer.recurrent_states[0] = None
    layer.is_recurrent_states_initialized[0] = False
    return state


def next_recurrent_state(state: torch.Tensor | None) -> torch.Tensor | None:
    """The state :func:`_ssm_step` computed from ``state`` (None if it did not run on it)."""
    return getattr(state, "forkrl_next", None) if state is not None else None


#: This area's entries (checked by ``tests/core/test_compat.py``).
PRIVATES: tuple[Private, ...] = (
    Private(
        "transformers",
        "transformers.models.{mamba,falcon_mamba,jamba,zamba}.mamba_selective_scan and *MambaMixer.forward "
        "(from 5.25, mamba_scan_forward and Cache.get_recurrent_states_to_keep)",
        "Mamba-1 mixers scan multi-token input from a zero state (transformers' torch path takes no initial "
        "state) and step single tokens in place: tree passes swap the module global for a scan that starts from "
        "the parent's state (same arguments), and hide that state from the mixer (layer_idx, the cache's "
        "recurrent state) so it always takes the scan; from 5.25 the mixer's mamba_scan_forward does this reading "
        "and storing, and steps a few last tokens one by one only where the cache asks for intermediate states "
        "(never for forkrl's layers)",
        _check_scan,
        CHECKED,
    ),
)
