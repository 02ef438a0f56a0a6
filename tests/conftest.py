"""Each host's tests run in that host's own environment (their pins conflict): tests/verl needs veRL
(.venv-verl) and is collected only where veRL imports; scripts/test.sh runs every environment."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("verl") is not None else ["verl"]
