"""Each host's tests run in that host's own environment (their pins conflict): tests/verl needs veRL
(.venv-verl), tests/openrlhf needs OpenRLHF (.venv-openrlhf), tests/trl_vllm needs TRL beside vLLM
(.venv-trl-vllm); each is collected only where what it needs imports. scripts/test.sh runs every
environment."""

import importlib.util


def _missing(*modules: str) -> bool:
    return any(importlib.util.find_spec(m) is None for m in modules)


collect_ignore = [host for host in ("verl", "openrlhf") if _missing(host)]
if _missing("trl", "vllm"):
    collect_ignore.append("trl_vllm")


def pytest_collection_modifyitems(config, items) -> None:
    """A test that times something is slow too: it needs a quiet machine, which the fast tier
    (``-m "not slow"``) does not ask for."""
    import pytest

    for item in items:
        if item.get_closest_marker("timing") is not None:
            item.add_marker(pytest.mark.slow)
    # scripts/test.sh hands each of two workers a whole file at a time, in collection order
    # (`-n 2 --dist loadfile`): files with slow tests go first, so that no long file starts last
    # while the other worker has nothing left. A stable sort: each file's own order is kept.
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)
