"""Loaded by veRL in every process (the ``verl.plugins`` entry point, or
``VERL_USE_EXTERNAL_MODULES=forkrl.plugins.verl.autoload``): registers forkrl's engine.

veRL logs a plugin's import failure at debug level only, so a failure here is logged as an error
before it is raised: a user who asked for forkrl's engine must not silently get veRL's own.
"""

import logging

from . import register

try:
    register()
except Exception:
    logging.getLogger(__name__).exception(
        "forkrl's veRL plugin failed to load; forkrl's engine is NOT active"
    )
    raise
