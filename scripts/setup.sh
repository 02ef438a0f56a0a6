#!/usr/bin/env bash
# Create or update the repo's virtual environment at .venv (idempotent).
#
#   bash scripts/setup.sh run    # forkrl, editable, with TRL (the [trl] extra: the README's main job is TRL GRPO)
#   bash scripts/setup.sh test   # the same plus the [dev] extra (pytest, hypothesis, ruff, build, TRL, ...)
#
# torch: if .venv can already import torch (for example a CUDA build you installed yourself), it is
# left alone. Otherwise torch==2.13.0 is installed first, explicitly: an unpinned torch would pull a
# multi-GB CUDA build. Set PYTHON to choose the interpreter that creates .venv (default python3).
# A second run with an unchanged pyproject.toml does nothing; FORKRL_SETUP_FORCE=1 reinstalls.
set -euo pipefail

mode="${1:-run}"
case "$mode" in
    run) spec=".[trl]" ;;
    test) spec=".[dev]" ;;
    *) echo "usage: bash scripts/setup.sh [run|test]" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PIP_DISABLE_PIP_VERSION_CHECK=1
TORCH_PIN="torch==2.13.0"

say() { echo "setup.sh: $*"; }

py="$root/.venv/bin/python"
pip_install() { "$py" -m pip install -q "$@"; }

if ! "$py" -c 'import sys' >/dev/null 2>&1; then
    base="${PYTHON:-python3}"
    "$base" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "forkrl needs Python >= 3.10, found " + sys.version.split()[0])'
    say "creating .venv with $("$base" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    "$base" -m venv "$root/.venv"
fi

# pip >= 23.0 (PEP 660 editable installs need >= 21.3; Python 3.10.0 shipped 21.2).
if ! "$py" -c 'import sys, pip; sys.exit(0 if tuple(int(x) for x in pip.__version__.split(".")[:2]) >= (23, 0) else 1)' \
        >/dev/null 2>&1; then
    say "upgrading pip"
    "$py" -m ensurepip --upgrade >/dev/null 2>&1 || true
    pip_install --upgrade pip
fi

if torch_version="$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null)"; then
    say "torch $torch_version already installed, leaving it alone"
else
    say "installing $TORCH_PIN"
    pip_install "$TORCH_PIN"
fi

# Skip the install when this mode (or `test`, which includes `run`) was already installed from the
# same pyproject.toml and the editable forkrl.core resolves to this checkout's core/.
stamp="$root/.venv/.forkrl-setup"
want="$("$py" -c 'import hashlib, sys; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
stamp_ok() {
    [ -f "$stamp" ] || return 1
    local have_mode have_hash
    read -r have_mode have_hash <"$stamp" || return 1
    [ "$have_hash" = "$want" ] || return 1
    [ "$have_mode" = "$mode" ] || [ "$have_mode" = "test" ]
}
# Run from / so that the checkout itself is not on sys.path: this checks the installed mapping.
resolves_here() {
    (cd / && "$py" -c 'import os, sys, forkrl.core
sys.exit(0 if os.path.realpath(forkrl.core.__path__[0]) == os.path.realpath(sys.argv[1]) else 1)' \
        "$root/core") >/dev/null 2>&1
}

if [ "${FORKRL_SETUP_FORCE:-0}" != "1" ] && stamp_ok; then
    if resolves_here; then
        say "forkrl ($mode) up to date in .venv"
        exit 0
    fi
    # Same dependencies, but the editable install points elsewhere (checkout moved or copied):
    # re-point it without touching dependencies or the network.
    say "re-pointing the editable install at $root"
    if "$py" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && resolves_here; then
        exit 0
    fi
fi

say "installing forkrl (pip install -e '$spec')"
rm -f "$stamp"
pip_install -e "$spec"
if ! resolves_here; then
    echo "setup.sh: error: after install, 'import forkrl.core' does not resolve to $root/core" >&2
    exit 1
fi
echo "$mode $want" >"$stamp"
say "done: $("$py" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')"
