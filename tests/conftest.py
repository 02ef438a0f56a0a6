"""Each host's tests run in that host's own environment (their pins conflict): tests/verl needs veRL
(.venv-verl), tests/openrlhf needs OpenRLHF (.venv-openrlhf); each is collected only where its host
imports. scripts/test.sh runs every environment."""

import importlib.util

collect_ignore = [host for host in ("verl", "openrlhf") if importlib.util.find_spec(host) is None]
