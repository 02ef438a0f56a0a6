#!/usr/bin/env bash
# Run every host's tests, each in its own environment (created by `bash scripts/setup.sh test`):
#   .venv        core, TRL plugin, packaging, examples, benchmarks   (.venv/bin/python -m pytest)
#   .venv-verl       the veRL plugin against real veRL               (tests/verl)
#   .venv-openrlhf   the OpenRLHF plugin against real OpenRLHF       (tests/openrlhf)
# Arguments go to the .venv runs (e.g. -x, -k name). Fails when any run fails or an environment
# collects nothing.
#
# The three suites run side by side, each to its own log (printed in order once all are done): much
# of their time goes to starting processes and importing (rank subprocesses, Ray workers, the hosts'
# launchers), which leaves a core idle. The tests that assert on measured speed or time (marker
# `timing`) would read that sharing as slowness: they run last, alone.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

status=0
run() {  # run LABEL PYTHON ARGS...: pytest; exit 5 (nothing collected) is a failure
    local label="$1" py="$2"
    shift 2
    echo "== $label: $py -m pytest $*"
    "$py" -m pytest "$@"
    local rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "scripts/test.sh: $label collected no tests: failing" >&2
    fi
    return "$rc"
}

# DeepSpeed compiles a CPU op on first use (about a minute; scripts/setup.sh prebuilds it): each
# environment keeps it in its own cache.
ext() { echo "${TORCH_EXTENSIONS_DIR:-$PWD/$1/torch_extensions}"; }

logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
TORCH_EXTENSIONS_DIR="$(ext .venv)" run "core + TRL" .venv/bin/python -m "not timing" "$@" >"$logs/venv" 2>&1 &
venv=$!
TORCH_EXTENSIONS_DIR="$(ext .venv-verl)" run "veRL" .venv-verl/bin/python tests/verl >"$logs/verl" 2>&1 &
verl=$!
TORCH_EXTENSIONS_DIR="$(ext .venv-openrlhf)" run "OpenRLHF" .venv-openrlhf/bin/python tests/openrlhf \
    >"$logs/openrlhf" 2>&1 &
openrlhf=$!
for job in venv verl openrlhf; do
    wait "${!job}" || status=1
    cat "$logs/$job"
done

# Alone: nothing else is running now. Exit 5 here only means the arguments selected no timing test.
echo "== core + TRL, timing: .venv/bin/python -m pytest -m timing $*"
TORCH_EXTENSIONS_DIR="$(ext .venv)" .venv/bin/python -m pytest -m timing "$@"
rc=$?
[ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1
exit "$status"
