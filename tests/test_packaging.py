"""Packaging invariants (docs/design.md, "Layout").

- The repo folders core/ and plugins/ install as forkrl.core and forkrl.plugins; the wheel holds
  nothing outside forkrl/ (no top-level `core` or `plugins` module) and every source file is in it.
- Nothing imports the bare top-level names `core` / `plugins` (that would load a second copy).
- core/ never imports a host library.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("forkrl", "core", "plugins")
# Folders scanned for bare `import core` / `import plugins`.
IMPORT_SCAN_DIRS = ("forkrl", "core", "plugins", "tests", "examples", "benchmarks")
HOST_LIBRARIES = {"trl", "verl", "openrlhf", "vllm", "deepspeed", "ray"}
# Never copied into the build tree (at any depth): caches, build outputs, virtual environments.
_SKIP_NAMES = {"__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "build", "dist"}


def _ignore(directory: str, names: list[str]) -> set[str]:
    d = Path(directory)
    skipped = set()
    for name in names:
        p = d / name
        if (
            name in _SKIP_NAMES
            or name.endswith(".egg-info")
            or (d == ROOT and name.startswith("."))
            or (p.is_dir() and (p / "pyvenv.cfg").exists())
        ):
            skipped.add(name)
    return skipped


def _python_files(*dirs: str) -> list[Path]:
    files = []
    for d in dirs:
        base = ROOT / d
        if base.is_dir():
            files += [p for p in base.rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(files)


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import statement in the file, at any depth.

    Parsed with ast rather than a regex so that docstrings and comments never match and
    `import os, core` or imports inside functions are still caught."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Build from a copy of the checkout so that a stale build/ folder cannot leak old files into
    # the wheel and the checkout is left untouched.
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_ignore)
    out = tmp / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"wheel build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    (out / "build.log").write_text(proc.stdout + proc.stderr)
    return wheels[0]


def test_wheel_builds_without_package_data_warnings(wheel: Path) -> None:
    """A data folder that looks like a Python package (a YAML folder named like a module) makes
    setuptools warn "Package ... is absent from the packages configuration" on every build."""
    log = (wheel.parent / "build.log").read_text()
    assert "absent from the `packages` configuration" not in log and "absent from the packages" not in log, (
        log[-3000:]
    )


def test_wheel_ships_every_verl_yaml(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    yamls = sorted((ROOT / "plugins/verl").rglob("*.yaml"))
    assert yamls
    for path in yamls:
        assert "forkrl/" + path.relative_to(ROOT).as_posix() in names, path


def test_wheel_contents(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/", 1)[0] for n in names}
    dist_info = {t for t in top_level if t.endswith(".dist-info")}
    assert top_level - dist_info == {"forkrl"}, f"unexpected top-level entries: {sorted(top_level)}"
    assert "core" not in top_level and "plugins" not in top_level

    py_files = [n for n in names if n.endswith(".py")]
    assert py_files and all(n.startswith("forkrl/") for n in py_files), py_files
    for required in (
        "forkrl/__init__.py",
        "forkrl/core/__init__.py",
        "forkrl/plugins/__init__.py",
        "forkrl/plugins/trl/__init__.py",
        "forkrl/plugins/openrlhf/__init__.py",
        "forkrl/plugins/verl/__init__.py",
    ):
        assert required in names, f"{required} missing from {wheel.name}"

    # Every source file is shipped: a subpackage missing from [tool.setuptools] packages fails here.
    expected = set()
    for path in _python_files(*SOURCE_DIRS):
        rel = path.relative_to(ROOT)
        if rel.parts[0] != "forkrl":
            rel = Path("forkrl", *rel.parts)
        expected.add(rel.as_posix())
    missing = sorted(expected - set(py_files))
    assert not missing, f"not in the wheel (list their packages in pyproject.toml): {missing}"

    for name in names:
        if name.endswith(".dist-info/top_level.txt"):
            assert zipfile.ZipFile(wheel).read(name).decode().split() == ["forkrl"]


def test_wheel_version_matches_package(wheel: Path) -> None:
    text = (ROOT / "forkrl" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)
    assert match, "forkrl/__init__.py defines no __version__"
    assert wheel.name.startswith(f"forkrl-{match.group(1)}-"), (wheel.name, match.group(1))


def test_no_bare_core_or_plugins_imports() -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in _python_files(*IMPORT_SCAN_DIRS)
        for line, module in _imported_modules(path)
        if module.split(".")[0] in {"core", "plugins"}
    ]
    assert not bad, "use `forkrl.core` / `forkrl.plugins` (or relative imports):\n" + "\n".join(bad)


def test_core_imports_no_host_library() -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in _python_files("core")
        for line, module in _imported_modules(path)
        if module.split(".")[0] in HOST_LIBRARIES
    ]
    assert not bad, "core/ must not import host libraries (plugins/ does that):\n" + "\n".join(bad)
