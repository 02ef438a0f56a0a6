"""Write every documented copy of forkrl's options from the option dataclasses (one source).

    python scripts/gen_options.py            # rewrite the generated blocks
    python scripts/gen_options.py --check    # exit 1 naming each file whose block drifted

The blocks sit between ``BEGIN GENERATED: <name>`` and ``END GENERATED: <name>`` lines:

- ``docs/trl.md`` (``options trl``): ``GRPOConfig``/``RLOOConfig`` fields, as Python;
- ``docs/verl.md`` (``options verl``): the ``forkrl`` block keys, as YAML;
- ``docs/openrlhf.md`` (``options openrlhf``): the launcher's ``--forkrl.*`` flags, with its overrides;
- ``plugins/verl/hydra-config/include/forkrl_base.yaml`` (``actor``, ``ref``): every key with its
  default (the reference's following the actor's), so any key overrides without ``+``.

The ``--help`` texts need no block: :func:`forkrl.core.options.add_arguments` reads the same
metadata when the parser is built. Runs in ``.venv`` (no host library is imported).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from forkrl.core import TreeOptions
from forkrl.core.options import OptionDoc, format_value, markdown_table, option_docs
from forkrl.core.speculative import SpeculativeOptions
from forkrl.core.train import GroupedRanksOptions
from forkrl.plugins.openrlhf.options import FLAG_OVERRIDES, FLAG_PREFIX, FLAGS, ForkrlOptions

ROOT = Path(__file__).resolve().parents[1]
VERL_BASE = ROOT / "plugins/verl/hydra-config/include/forkrl_base.yaml"


def _trl() -> str:
    docs = option_docs(TreeOptions) + option_docs(GroupedRanksOptions) + option_docs(SpeculativeOptions)
    return markdown_table(docs, key="{name}", style="python")


def _verl() -> str:
    table = markdown_table(option_docs(TreeOptions), key="forkrl.{name}", style="yaml")
    return (
        "Defaults as in `include/forkrl_base.yaml`; `forkrl_tree.yaml` sets `tree_packing: true`, "
        "`forkrl_long_context.yaml` also `long_context_replay: true` and `tree_block_size: 2048`.\n\n" + table
    )


def _openrlhf() -> str:
    docs = option_docs(ForkrlOptions, only=FLAGS, overrides=FLAG_OVERRIDES)
    return markdown_table(docs, key=FLAG_PREFIX + "{name}", style="flag")


def _yaml(doc: OptionDoc) -> str:
    """``name: default`` with a comment of the allowed values (the help is in docs/verl.md)."""
    value = format_value(doc.default, "yaml")
    if doc.choices is not None:
        note = " | ".join(map(str, doc.choices))
    elif isinstance(doc.default, bool):
        note = "true | false"
    else:
        unset = re.search(r"\(default ([^)]*)\)", doc.help)
        note = f"a number; null: {unset[1]}" if unset else "a number"
    return f"{doc.name}: {value}  # {note}"


def _verl_actor() -> str:
    return "\n".join(_yaml(doc) for doc in option_docs(TreeOptions))


def _verl_ref() -> str:
    return "\n".join(
        f"{d.name}: ${{actor_rollout_ref.actor.forkrl.{d.name}}}" for d in option_docs(TreeOptions)
    )


#: (file, block name, render): every generated block.
BLOCKS: list[tuple[Path, str, Callable[[], str]]] = [
    (ROOT / "docs/trl.md", "options trl", _trl),
    (ROOT / "docs/verl.md", "options verl", _verl),
    (ROOT / "docs/openrlhf.md", "options openrlhf", _openrlhf),
    (VERL_BASE, "actor", _verl_actor),
    (VERL_BASE, "ref", _verl_ref),
]


def render(text: str, name: str, body: str, path: Path) -> str:
    """``text`` with the block ``name`` replaced by ``body`` (indented and commented as its markers).

    Raises:
        ValueError: the markers are missing.
    """
    pattern = re.compile(
        rf"^(?P<indent>[ \t]*)(?P<open>(?:# |<!-- )BEGIN GENERATED: {re.escape(name)}(?: -->)?)\n"
        rf".*?^(?P=indent)(?P<close>(?:# |<!-- )END GENERATED: {re.escape(name)}(?: -->)?)$",
        re.M | re.S,
    )
    match = pattern.search(text)
    if match is None:
        raise ValueError(f"{path}: no 'BEGIN GENERATED: {name}' ... 'END GENERATED: {name}' block")
    indent = match["indent"]
    lines = "".join(f"{indent}{line}\n" if line else "\n" for line in body.split("\n"))
    block = f"{indent}{match['open']}\n{lines}{indent}{match['close']}"
    return text[: match.start()] + block + text[match.end() :]


def generate() -> dict[Path, str]:
    """Every file with its generated blocks written: ``{path: new text}``."""
    out: dict[Path, str] = {}
    for path, name, body in BLOCKS:
        out[path] = render(out.get(path, path.read_text()), name, body(), path)
    return out


def drifted() -> list[Path]:
    """The files whose generated blocks differ from what the dataclasses give."""
    return [path for path, text in generate().items() if path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="only report drift (exit 1)")
    args = parser.parse_args(argv)
    if args.check:
        stale = drifted()
        for path in stale:
            print(f"{path.relative_to(ROOT)}: generated options drifted: run python scripts/gen_options.py")
        return 1 if stale else 0
    for path, text in generate().items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
