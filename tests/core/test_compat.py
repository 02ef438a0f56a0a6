"""Every transformers/torch private core relies on (forkrl.core.compat) is still where it was, and
the option dataclasses derive working command-line flags (the form OpenRLHF's launcher takes)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import tomllib
import transformers

from forkrl.core import TreeOptions, compat
from forkrl.core.options import add_arguments, from_namespace
from forkrl.core.speculative import SpeculativeOptions


@pytest.mark.parametrize("private", compat.PRIVATES, ids=lambda p: p.name)
def test_private_is_where_core_expects_it(private):
    try:
        private.check()
    except Exception as err:  # noqa: BLE001 - report any breakage with the entry's reason
        pytest.fail(
            f"{private.name} changed (checked against {compat.CHECKED}; used for: {private.why}): {err!r}"
        )


def test_every_core_entry_is_one_registry_form():
    """Core's entries are :class:`compat.Private` (the form every plugin uses), each naming its host
    and the versions it was checked against; gathered area by area, none twice."""
    assert all(isinstance(p, compat.Private) for p in compat.PRIVATES)
    assert {p.host for p in compat.PRIVATES} == {"transformers", "torch"}
    assert all(p.checked == compat.CHECKED for p in compat.PRIVATES)
    assert len({p.name for p in compat.PRIVATES}) == len(compat.PRIVATES)


def test_a_failing_check_says_what_changed_in_the_host():
    def probe():
        raise AttributeError("type object 'Cache' has no attribute 'layers'")

    private = compat.Private(
        "transformers", "Cache.layers", "the executor replaces a cache's layers", probe, "x 1.0"
    )
    with pytest.raises(AssertionError) as err:
        private.check()
    message = str(err.value)
    for part in (
        "transformers changed: Cache.layers",
        "has no attribute 'layers'",
        "replaces a cache's layers",
        "x 1.0",
    ):
        assert part in message, message


def test_every_name_core_reads_from_compat_exists():
    """Core reaches the privates as ``compat.<name>`` on the package: each such name is re-exported
    from its area (a name left out fails only on the path that reads it, e.g. CUDA's)."""
    core = Path(__file__).parents[2] / "core"
    used = {
        (name, str(path.relative_to(core)))
        for path in core.rglob("*.py")
        if "compat" not in path.parts
        for name in re.findall(r"\bcompat\.([A-Za-z_]\w*)", path.read_text())
    }
    assert used and not sorted((n, p) for n, p in used if not hasattr(compat, n))


def test_the_dev_environment_pins_the_checked_transformers():
    """The test environment installs the transformers the privates were checked against (CI must not
    test whatever release came out that day), and this run uses it."""
    checked = re.search(r"transformers (\S+)", compat.CHECKED).group(1)
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert f"transformers=={checked}" in pyproject["project"]["optional-dependencies"]["dev"]
    assert transformers.__version__ == checked, (
        f"transformers {transformers.__version__} installed, the privates were checked against {checked}: "
        "run `bash scripts/setup.sh test`, or move the pin and compat.CHECKED together after checking"
    )


def test_every_private_says_why():
    assert compat.PRIVATES and all(len(p.why) > 30 for p in compat.PRIVATES)


def test_flags_derived_from_the_option_dataclasses():
    parser = argparse.ArgumentParser()
    add_arguments(parser, TreeOptions, prefix="--forkrl.")
    add_arguments(parser, SpeculativeOptions, prefix="--forkrl.")
    args = parser.parse_args(
        ["--forkrl.tree_packing", "--forkrl.tree_mode", "replay", "--forkrl.tree_block_size", "256",
         "--forkrl.long_context_replay", "false"]
    )  # fmt: skip
    opts = from_namespace(TreeOptions, args, prefix="forkrl.")
    assert opts == TreeOptions(tree_packing=True, tree_mode="replay", tree_block_size=256)
    assert from_namespace(SpeculativeOptions, args, prefix="forkrl.") == SpeculativeOptions()
    with pytest.raises(SystemExit):
        parser.parse_args(["--forkrl.tree_mode", "fast"])
    bad = parser.parse_args(["--forkrl.tree_block_size", "512"])  # parses, but tree_packing is off
    with pytest.raises(ValueError, match="tree_block_size set but tree_packing=False"):
        from_namespace(TreeOptions, bad, prefix="forkrl.")
    help_text = parser.format_help()
    assert "--forkrl.tree_mode {auto,keep,replay,packed}" in help_text and "Block size in tokens" in help_text


def test_parameter_names_read_through_a_function_wrapped_in_a_module():
    """transformers 5.25 wraps kernel functions (the Mamba steps and scans) into modules whose
    ``forward`` is the function: the checks compare the arguments callers pass, the same as before."""
    import torch

    class Wrapped(torch.nn.Module):
        def forward(self, state, hidden_states, dt=None, **kwargs):
            return state

    def plain(state, hidden_states, dt=None, **kwargs):
        return state

    assert compat.parameter_names(Wrapped()) == compat.parameter_names(plain) == [
        "state", "hidden_states", "dt", "kwargs"
    ]  # fmt: skip


def test_function_source_reads_a_function_wrapped_in_a_module(tmp_path, monkeypatch):
    """From 5.25 (with ``kernels``) transformers' module-level Mamba scans are module instances
    whose class ``inspect`` cannot find: the source checks read the function from the module's file."""
    import importlib
    import inspect

    import torch

    (tmp_path / "wrapped_fn_module.py").write_text(
        "def scan_forward(module, cache):\n    return cache.get_recurrent_state(module.layer_idx)\n\n\n"
        "def other():\n    return 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("wrapped_fn_module")
    plain = compat.function_source(module, "scan_forward")
    assert plain == inspect.getsource(module.scan_forward).rstrip("\n")
    wrapper = type("Func", (torch.nn.Module,), {"forward": lambda self, *args, **kwargs: None})
    monkeypatch.setattr(module, "scan_forward", wrapper())
    with pytest.raises((OSError, TypeError)):
        inspect.getsource(type(module.scan_forward))
    assert compat.function_source(module, "scan_forward") == plain
    assert plain.startswith("def scan_forward(") and "get_recurrent_state(module.layer_idx)" in plain
    assert "def other" not in plain
