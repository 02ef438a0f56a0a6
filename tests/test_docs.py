"""The documentation holds together: a one-screen README that links every page, links and anchors
that resolve, benchmark commands that exist, the generated models page up to date, and
docs/design.md's layout naming every module under core/ and plugins/ and no path that is gone.

Reads files only (no model, no sweep, no network): well under a second.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
HOSTS = ("trl", "verl", "openrlhf")

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


def _prose(text: str) -> list[str]:
    """The lines outside fenced and indented code blocks, with inline code spans blanked."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced or line.startswith(("    ", "\t")):
            continue
        lines.append(re.sub(r"`[^`]*`", "``", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lowercased, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The link and image targets in a page's prose."""
    return [m.group(1) for line in _prose(path.read_text()) for m in _LINK.finditer(line)]


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:, ...


def test_slugs_follow_github():
    assert slug("Sharded engines: FSDP2 and DeepSpeed") == "sharded-engines-fsdp2-and-deepspeed"
    assert slug("Writing a plugin: the host-neutral step") == "writing-a-plugin-the-host-neutral-step"
    assert slug("What each host's flags map to") == "what-each-hosts-flags-map-to"
    assert slug("`tree_balance` options") == "tree_balance-options"


def test_readme_is_one_screen_and_links_every_page():
    assert len(README.read_text().splitlines()) < 150
    linked = {(README.parent / t.split("#")[0]).resolve() for t in links(README) if _relative(t)}
    missing = [p.name for p in DOCS if p.resolve() not in linked]
    assert DOCS and not missing, f"docs pages not linked from README.md: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path):
    bad = []
    for target in links(page):
        if not _relative(target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


def test_benchmark_commands_exist():
    named = set()
    for page in PAGES:
        named |= set(re.findall(r"python -m benchmarks\.([a-z0-9_]+)", page.read_text()))
    assert "trl_step" in named  # the scan sees the results page's commands
    missing = sorted(n for n in named if not (ROOT / "benchmarks" / f"{n}.py").exists())
    assert not missing, f"python -m benchmarks.X with no benchmarks/X.py: {missing}"


@pytest.mark.parametrize("host", HOSTS)
def test_host_page_has_one_generated_options_table(host: str):
    text = (ROOT / "docs" / f"{host}.md").read_text()
    begin, end = f"<!-- BEGIN GENERATED: options {host} -->", f"<!-- END GENERATED: options {host} -->"
    assert text.count(begin) == 1 and text.count(end) == 1
    block = text.split(begin, 1)[1].split(end, 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("|")]
    assert text.index(begin) < text.index(end) and len(rows) > 2 and rows[1].startswith("|---"), block[:300]


def test_trl_page_shows_the_readme_snippet():
    """One snippet for the TRL plugin: the README's (run by tests/test_examples.py) is the host page's."""

    def first_python(text: str) -> str:
        return text.split("```python\n", 1)[1].split("```", 1)[0]

    readme = README.read_text().split("## Using it in TRL", 1)[1]
    assert first_python(readme) == first_python((ROOT / "docs" / "trl.md").read_text())


def test_models_page_is_the_generators_output():
    """docs/models.md is scripts/models_page.py's rendering of the saved sweep (no sweep is run)."""
    spec = importlib.util.spec_from_file_location("models_page", ROOT / "scripts" / "models_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.load()
    page = (ROOT / "docs" / "models.md").read_text()
    assert page == module.render(result), "docs/models.md is stale: run python scripts/models_page.py"
    # Every architecture of the sweep is on the page, in the section of its outcome.
    for row in result["rows"]:
        assert f"`{row['model_type']}`" in page, row["model_type"]
    assert f"## Refused ({sum(r['status'] == 'refused' for r in result['rows'])})" in page


# ---------------------------------------------------------------------------- design.md's layout

DESIGN = ROOT / "docs" / "design.md"
_ENTRY_INDENT = 8  # a layout line indented less than this starts an entry; deeper lines continue one
_PY_NAME = re.compile(r"(?<![\w./-])([\w./-]*\w\.py)\b")


def layout_entries(text: str) -> dict[str, str]:
    """The Layout section's code block as ``{path: description}``: an entry's path is its first word
    under the nearest less indented folder entry (``core/`` then ``  tree/`` is ``core/tree/``), its
    description the rest of its line and the deeper-indented lines that follow."""
    section = ("\n" + text).split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1].split("\n", 1)[1]
    entries: dict[str, str] = {}
    parents: list[tuple[int, str]] = []  # (indent, folder path) of the open folder entries
    last = None
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent >= _ENTRY_INDENT:
            entries[last] += " " + line.strip()
            continue
        while parents and parents[-1][0] >= indent:
            parents.pop()
        word, _, rest = line.strip().partition(" ")
        last = (parents[-1][1] if parents else "") + word
        entries[last] = rest.strip()
        if word.endswith("/"):
            parents.append((indent, last))
    return entries


def layout_names(entries: dict[str, str]) -> set[str]:
    """Every path the section names: the entries, and each ``name.py`` in an entry's description
    (relative to the entry's folder, or to the repository root when it holds a ``/``)."""
    names = set(entries)
    for path, description in entries.items():
        folder = path if path.endswith("/") else path.rpartition("/")[0] + "/"
        for name in _PY_NAME.findall(description):
            names.add(name if "/" in name else (folder + name).lstrip("/"))
    return names


def modules(top: str) -> set[str]:
    """Every module under ``top``: each package as ``folder/`` and each ``.py`` file but ``__init__.py``."""
    out = set()
    for path in (ROOT / top).rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py":
            out.add(rel.rpartition("/")[0] + "/")
        else:
            out.add(rel)
    return out


def _exists(name: str) -> bool:
    return any(ROOT.glob(name.rstrip("/"))) if "*" in name else (ROOT / name).exists()


# A repository path in backticks: core/, plugins/, scripts/, benchmarks/ or a tests/ folder, with an
# optional pytest node id (tests/core/test_x.py::test_y). Top-level tests/test_*.py are left out: the
# pages also name TRL's own test files by their path in TRL.
_REPO_PATH = re.compile(r"`((?:core|plugins|scripts|benchmarks|tests/[a-z_]+)/[\w./*-]*)(?:::[^`]*)?`")


def test_pages_name_real_paths():
    """Every repository path a page names in backticks exists (modules move: the message says where)."""
    bad = []
    for page in PAGES:
        for path in sorted(set(_REPO_PATH.findall(page.read_text()))):
            if not _exists(path):
                bad.append(f"{page.relative_to(ROOT)}: `{path}`")
    assert not bad, "pages name paths that do not exist (name where the file is now): " + "; ".join(bad)


def test_layout_section_parses():
    block = "core/   c\n  tree/  t (forest.py)\n        more\n  errors.py  e\nx.py  y\n"
    entries = layout_entries(f"## Layout\n\n```\n{block}```\n")
    assert entries == {"core/": "c", "core/tree/": "t (forest.py) more", "core/errors.py": "e", "x.py": "y"}
    assert layout_names(entries) == {*entries, "core/tree/forest.py"}


def test_design_layout_names_every_module_and_only_real_paths():
    """docs/design.md's Layout section names every package and module under core/ and plugins/ (as an
    entry, or as ``name.py`` in its folder's description) and no path that does not exist."""
    names = layout_names(layout_entries(DESIGN.read_text()))
    unnamed = sorted((modules("core") | modules("plugins")) - names)
    gone = sorted(n for n in names if not _exists(n))
    problems = []
    if unnamed:
        problems.append("add (a module the section does not name): " + ", ".join(unnamed))
    if gone:
        problems.append("remove or rename (named, but no such path): " + ", ".join(gone))
    message = "docs/design.md, section Layout, is out of date with the tree:\n  " + "\n  ".join(problems)
    assert not problems, message
