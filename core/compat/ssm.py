"""The Mamba-2 one-token SSM step transformers' mixers call, made out of place for tree passes
(a node's recurrent state must not be overwritten while its children still read it)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn

from .registry import CHECKED, Private, function_source, parameter_names

# Mamba-2 mixers whose one-token step writes the recurrent state in place (record_past covers
# their conv; the SSM step ignores it). Up to transformers 5.24 the mixer steps the cache's own
# state; from 5.25 its module-level ``mamba2_scan_forward`` steps a copy (``recurrent_state.clone()``)
# and stores that copy through ``update_recurrent_state``, so the copy must end up holding the new state.
_SSM_MODULES = ("bamba", "falcon_h1", "granitemoehybrid", "mamba2", "nemotron_h", "zamba2")
_SSM_STEP = "mamba2_selective_state_update"
_SSM_ARGS = ["state", "hidden_states", "dt", "A", "B", "C", "D", "dt_bias", "dt_softplus", "z", "kwargs"]
_SSM_SCAN_FORWARD = "mamba2_scan_forward"  # 5.25: the mixers' scan, read from and stored to the cache


def _steps_a_copy(module) -> bool:
    """Whether the module's mixers step a copy of the cache's state and store the copy (5.25 on)."""
    return hasattr(module, _SSM_SCAN_FORWARD)


def _check_ssm_step() -> None:
    import importlib
    import re

    for name in _SSM_MODULES:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        assert parameter_names(getattr(module, _SSM_STEP)) == _SSM_ARGS, name
        if _steps_a_copy(module):
            assert re.search(rf"{_SSM_SCAN_FORWARD}\(\s*self,", inspect.getsource(module)), name
            src = function_source(module, _SSM_SCAN_FORWARD)
            assert "next_state = recurrent_state.clone()" in src, name
            assert re.search(rf"{_SSM_STEP}\(\s*next_state,", src), name
            assert "cache.update_recurrent_state(next_state, module.layer_idx)" in src, name
        else:
            assert re.search(rf"{_SSM_STEP}\(\s*recurrent_state,", inspect.getsource(module)), name


def _ssm_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None):
    """One Mamba-2 SSM step, out of place: ``h' = exp(dt A) h + dt B x``, ``y = C h' + D x`` (gated
    by ``silu(z)``), shapes as transformers' step (``state [b, heads, head_dim, n]``, ``x, dt
    [b, heads, head_dim]``, ``B, C [b, groups, n]``). Returns ``(y, h')``, ``h'`` in ``state``'s dtype."""
    batch, heads, head_dim = hidden_states.shape
    groups, n = B.shape[1], B.shape[-1]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = dt[..., None]
    decay = torch.exp(dt.float() * A.float()).to(device=state.device)

    def per_head(t):  # [b, groups, n] -> [b, heads, n]
        return t[:, :, None, :].expand(batch, groups, heads // groups, n).reshape(batch, heads, n)

    inflow = (dt * per_head(B)[:, :, None, :] * hidden_states[..., None]).to(device=state.device)
    ssm = state * decay + inflow
    new_state = ssm.to(state.dtype)
    ssm = ssm.to(device=C.device, dtype=C.dtype)
    out = (ssm * per_head(C)[:, :, None, :]).sum(-1)
    if D is not None:
        out = (out + hidden_states * D).to(out.dtype)
    if z is not None:
        out = out * torch.nn.functional.silu(z)
    return out.to(hidden_states.dtype), new_state


def _ssm_step(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs):
    """:func:`_ssm_update` where the mixer steps the cache's own state (up to 5.24): that state is
    left as it was (a view of the parent's leaf tensor) and the next one rides on ``state.forkrl_next``."""
    out, state.forkrl_next = _ssm_update(state, hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z)
    return out


def _ssm_step_on_copy(
    state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs
):
    """:func:`_ssm_update` where the mixer steps a copy it then stores (5.25 on): the copy, which only
    ``clone`` produced and nothing saved, takes the new state in place; the update reads a second
    copy, so no tensor autograd saved is overwritten."""
    out, new_state = _ssm_update(state.clone(), hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z)
    state.copy_(new_state)
    return out


def ssm_step_modules(model: nn.Module) -> list:
    """The transformers modeling modules of ``model``'s Mamba-2 mixers (for :func:`out_of_place_ssm_step`)."""
    import sys

    modules = {sys.modules.get(type(m).__module__) for m in model.modules()}
    return [m for m in modules if m is not None and m.__name__.rsplit(".", 1)[-1].removeprefix("modeling_")
            in _SSM_MODULES and hasattr(m, _SSM_STEP)]  # fmt: skip


@contextlib.contextmanager
def out_of_place_ssm_step(modules: list) -> Iterator[None]:
    """For the duration, the Mamba-2 mixers of ``modules`` (:func:`ssm_step_modules`) take
    :func:`_ssm_step` (or :func:`_ssm_step_on_copy`) for one-token steps."""
    saved = [(m, getattr(m, _SSM_STEP)) for m in modules]
    for m, _ in saved:
        setattr(m, _SSM_STEP, _ssm_step_on_copy if _steps_a_copy(m) else _ssm_step)
    try:
        yield
    finally:
        for m, fn in saved:
            setattr(m, _SSM_STEP, fn)


#: This area's entries (checked by ``tests/core/test_compat.py``).
PRIVATES: tuple[Private, ...] = (
    Private(
        "transformers",
        "transformers.models.{bamba,falcon_h1,granitemoehybrid,mamba2,nemotron_h,zamba2}.mamba2_selective_state_update "
        "(and, from 5.25, mamba2_scan_forward)",
        "the Mamba-2 one-token SSM step (a module global the mixers call) writes the recurrent state in place "
        "(state.copy_ after reading it), which autograd cannot take through a state restored from a tree node: tree "
        "passes swap in a step with the same arguments that reads the state out of place; up to 5.24 the mixer steps "
        "the cache's state and the new one rides on it, from 5.25 mamba2_scan_forward steps a clone and stores that "
        "clone, which the swapped step then overwrites with the new state",
        _check_ssm_step,
        CHECKED,
    ),
)
