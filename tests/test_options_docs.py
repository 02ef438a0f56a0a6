"""One source for option docs: every generated copy (the hosts' docs tables, veRL's YAML defaults)
equals what the option dataclasses give, so a changed default or help text fails here until
``python scripts/gen_options.py`` is run."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

from forkrl.core import TreeOptions
from forkrl.core.options import option_docs

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_options", ROOT / "scripts/gen_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_generated_block_drifted():
    gen = _generator()
    stale = [str(p.relative_to(ROOT)) for p in gen.drifted()]
    assert not stale, f"{stale}: run python scripts/gen_options.py"


def test_a_changed_help_text_is_caught(monkeypatch):
    """The check can fail: a help text edited in the dataclass no longer matches the docs."""
    gen = _generator()
    field = TreeOptions.__dataclass_fields__["tree_mode"]
    monkeypatch.setattr(field, "metadata", {"help": "changed"})
    assert {p.name for p in gen.drifted()} >= {"trl.md", "verl.md", "openrlhf.md"}


def test_verl_yaml_holds_every_option_with_its_default():
    base = yaml.safe_load((ROOT / "plugins/verl/hydra-config/include/forkrl_base.yaml").read_text())
    actor = base["actor_rollout_ref"]["actor"]["forkrl"]
    ref = base["actor_rollout_ref"]["ref"]["forkrl"]
    docs = option_docs(TreeOptions)
    assert actor == {d.name: d.default for d in docs}
    assert ref == {d.name: f"${{actor_rollout_ref.actor.forkrl.{d.name}}}" for d in docs}


def test_each_host_table_lists_every_option_it_takes():
    from forkrl.core.speculative import SpeculativeOptions
    from forkrl.plugins.openrlhf.options import FLAGS

    def keys(page: str) -> list[str]:
        text = (ROOT / "docs" / page).read_text()
        block = re.search(r"BEGIN GENERATED: options \w+ -->(.*?)<!-- END", text, re.S)[1]
        return re.findall(r"^\| `([^`]+)` \|", block, re.M)

    tree = [d.name for d in option_docs(TreeOptions)]
    spec = [d.name for d in option_docs(SpeculativeOptions)]
    assert keys("trl.md") == tree + ["long_context_cp_size"] + spec  # TRL groups its own processes
    assert keys("verl.md") == [f"forkrl.{n}" for n in tree]
    assert keys("openrlhf.md") == [f"--forkrl.{n}" for n in FLAGS]
