"""Mamba-1's selective scan from an initial state, so a tree node continues its parent's SSM state.

transformers' torch path of the Mamba-1 mixers (Mamba, FalconMamba, Jamba's Mamba layers, Zamba)
scans multi-token input from a zero state and steps a single token in place, so a node forwarded
with its parent's cache would restart the recurrence (the conv state is carried by the cache and
needs nothing here). Inside :func:`continuing` the mixers' scan is :func:`selective_scan` started
from the parent's state, which is taken off the cache before each mixer runs (the mixer then takes
its scan even for one token, and stores the final state through the recording cache layer).

The recurrence (Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces",
2023, Algorithm 2), per channel ``d`` and state index ``n``::

    h_t = exp(dt_t A) * h_{t-1} + dt_t B_t x_t        (h_0 = the parent's final state, or 0)
    y_t = C_t . h_t + D x_t,  gated by silu(z_t)

with the same operations, in the same dtypes, as transformers' sequential loop: a path's first
node is that loop exactly, and a child continues from the very tensor the loop would carry on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from .. import compat

__all__ = ["continuing", "selective_scan"]

# The initial states of the mixer now running, one per scan call it makes (Zamba scans each head).
_INITIAL: ContextVar[list[torch.Tensor] | None] = ContextVar("forkrl_scan_initial", default=None)


def selective_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan over ``L`` tokens from ``initial_state`` (zeros when None), out of place.

    Args:
        hidden_states: ``[batch, d, L]`` the conv's output ``x``.
        dt: ``[batch, d, L]`` time steps before ``delta_bias`` and softplus.
        A: ``[d, n]`` (negative) state matrix.
        B: ``[batch, n, L]``.
        C: ``[batch, n, L]``.
        D: ``[d]`` skip, or None.
        z: ``[batch, d, L]`` gate, or None.
        delta_bias: ``[d]`` added to ``dt``, or None.
        delta_softplus: apply softplus to ``dt``.
        initial_state: ``[batch, d, n]`` the state before the first token, or None.

    Returns:
        ``(y [batch, d, L], final state [batch, d, n])``.
    """
    batch, channels, length = hidden_states.shape
    input_dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    B, C = B.transpose(1, 2), C.transpose(1, 2)  # [batch, L, n]
    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # [batch, d, L, n]
    inflow = dt[:, :, :, None] * B[:, None, :, :].float() * hidden_states[:, :, :, None].float()
    state = initial_state
    if state is None:
        state = torch.zeros(batch, channels, A.shape[-1], dtype=input_dtype, device=hidden_states.device)
    outputs = []
    for t in range(length):
        state = decay[:, :, t] * state + inflow[:, :, t]
        outputs.append(torch.matmul(state.to(input_dtype), C[:, t, :].unsqueeze(-1))[:, :, 0])
    out = torch.stack(outputs, dim=-1)
    if D is not None:
        out = out + hidden_states * D[None, :, None]
    if z is not None:
        out = out * F.silu(z)
    return out, state


def _scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    **kwargs,
):
    """transformers' ``mamba_selective_scan`` signature, started from the running mixer's state."""
    queue = _INITIAL.get()
    initial = queue.pop(0) if queue else None
    out, last = selective_scan(hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, initial)
    return (out, last) if return_last_state else out


@contextlib.contextmanager
def continuing(mixers: list[nn.Module], cache: compat.Cache | None) -> Iterator[None]:
    """For one forward through ``cache``: every Mamba-1 mixer of ``mixers``
    (:func:`forkrl.core.compat.scan_mixers`) scans from the recurrent state its cache layer holds
    (``[batch, d, n]``, Zamba ``[batch, heads, head_dim, n]``: one scan per head)."""
    if not mixers or cache is None:
        yield
        return

    def before(mixer: nn.Module) -> None:
        state = compat.take_recurrent_state(cache, compat.mixer_layer(mixer))
        _INITIAL.set([] if state is None else list(state.unbind(1)) if state.dim() == 4 else [state])

    token = _INITIAL.set(None)
    try:
        with compat.scan_replaced(mixers, _scan, before):
            yield
    finally:
        _INITIAL.reset(token)
