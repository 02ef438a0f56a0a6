"""forkrl for veRL: tree training and prefix-shared scoring in veRL's FSDP2 engine, by one override YAML.

    python -m verl.trainer.main_ppo --config-path "$(python -m forkrl.plugins.verl)" \
        --config-name forkrl_tree <your usual overrides>

- :mod:`.engine`: the FSDP2 engine subclass (backend ``fsdp2_tree``), ``forward_backward_batch``
  over :class:`forkrl.core.train.TreeStep`.
- :mod:`.config`: ``ForkrlFSDPActorConfig`` (``FSDPActorConfig`` plus a ``forkrl`` block).
- :mod:`.balance`: ``forkrl.tree_balance``, each mini-batch's rows moved between the dp ranks by tree cost.
- :mod:`.compat`: every veRL private the plugin relies on, checked by the contract tests.
- :mod:`.autoload`: the ``verl.plugins`` entry point (registers the engine in every veRL process).
- ``config/``: the override YAMLs, primary: ``forkrl_tree``, ``forkrl_long_context``,
  ``forkrl_speculative``, ``forkrl_tree_speculative``; composed by them: ``forkrl_base``,
  ``forkrl_speculative_base``.

:func:`register` adds the engine to veRL's registry; veRL's worker processes call it through the
``verl.plugins`` entry point (module :mod:`.autoload`), which logs one INFO line when active.

Needs veRL (``pip install 'forkrl[verl]'``).
"""

from __future__ import annotations

import logging
from pathlib import Path

__all__ = ["AUTOLOAD", "CONFIG_DIR", "MODULES_RESOLVER", "external_modules", "register"]

logger = logging.getLogger(__name__)

#: The folder of forkrl's override YAMLs (pass it to veRL's --config-path).
CONFIG_DIR = Path(__file__).resolve().parent / "config"

_registered = False

#: The OmegaConf resolver forkrl_base.yaml composes the workers' ``VERL_USE_EXTERNAL_MODULES`` with.
MODULES_RESOLVER = "forkrl_external_modules"
AUTOLOAD = "forkrl.plugins.verl.autoload"


def external_modules(user: str = "") -> str:
    """``VERL_USE_EXTERNAL_MODULES`` for veRL's Ray workers: the user's own modules (a platform
    module, a custom reward module: comma-separated, as veRL splits it), then forkrl's autoload."""
    modules = [m.strip() for m in str(user or "").split(",") if m.strip()]
    return ",".join(modules + ([AUTOLOAD] if AUTOLOAD not in modules else []))


def register() -> None:
    """Register forkrl's engine with veRL's ``EngineRegistry`` (idempotent)."""
    global _registered
    if _registered:
        return
    try:
        from verl.workers.engine.base import EngineRegistry
    except ImportError as err:  # pragma: no cover - exercised only without veRL
        raise ImportError("forkrl.plugins.verl needs veRL: pip install 'forkrl[verl]' (verl>=0.9.1)") from err
    from .engine import BACKEND, TreeFSDPEngineWithLMHead

    EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "npu"])(
        TreeFSDPEngineWithLMHead
    )
    from omegaconf import OmegaConf

    # forkrl_base.yaml's Ray workers load forkrl beside the modules the user names in the variable.
    OmegaConf.register_new_resolver(MODULES_RESOLVER, external_modules, replace=True)
    _registered = True
    logger.info("forkrl: veRL plugin loaded; engine backend %r registered for language models", BACKEND)
