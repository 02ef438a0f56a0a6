"""The wheels carried to the GPU machine (``scripts/gpu_wheels.sh``) put on ``sys.path``.

Each pure-Python wheel is unpacked into one temporary folder (removed at exit) (a wheel's files, its ``.dist-info``
included, so ``importlib.metadata`` finds their versions), which is appended to ``sys.path``: a
package the machine already has comes first and is never shadowed. Nothing is installed.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path


def put_on_path(folder: Path) -> dict:
    """Unpack every ``*-none-any.whl`` of ``folder`` and append the unpacked tree to ``sys.path``.

    Returns:
        ``{"folder", "site", "wheels", "refused"}``: the wheels unpacked and those refused (not
        pure Python); ``{"folder", "wheels": []}`` when the folder has none.
    """
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    pure = [w for w in wheels if w.name.endswith("-none-any.whl")]
    out: dict = {"folder": str(folder), "wheels": [w.name for w in pure]}
    refused = [w.name for w in wheels if w not in pure]
    if refused:
        out["refused"] = refused
    if not pure:
        return out
    site = Path(tempfile.mkdtemp(prefix="gpu_check_site_"))
    atexit.register(shutil.rmtree, site, ignore_errors=True)
    for wheel in pure:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    sys.path.append(str(site))
    out["site"] = str(site)
    return out


def versions(*names: str) -> dict[str, str | None]:
    """Installed (or unpacked) versions of distributions, None where absent."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out
