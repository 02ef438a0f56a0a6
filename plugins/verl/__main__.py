"""``python -m forkrl.plugins.verl`` prints the folder to pass to veRL's ``--config-path``."""

from . import CONFIG_DIR

print(CONFIG_DIR)
