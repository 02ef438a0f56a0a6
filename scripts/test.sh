#!/usr/bin/env bash
# Run every host's tests, each in its own environment (created by `bash scripts/setup.sh test`):
#   .venv        core, TRL plugin, packaging, examples, benchmarks   (.venv/bin/python -m pytest)
#   .venv-verl       the veRL plugin against real veRL               (tests/verl)
#   .venv-openrlhf   the OpenRLHF plugin against real OpenRLHF       (tests/openrlhf)
# Arguments go to the first run (e.g. -x, -k name). Fails when any environment's tests fail or collect nothing.
#
# One suite at a time: the work is CPU-bound (all three side by side took longer, 30:51 against 28:29),
# and tests whose plans follow measured timings (the `timing` marker; the balancers' online cost
# models) must not share the machine: OpenRLHF's two-rank balanced test once failed beside veRL's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

status=0
run() {  # run LABEL PYTHON ARGS...
    local label="$1" py="$2"
    shift 2
    echo "== $label: $py -m pytest $*"
    "$py" -m pytest "$@"
    local rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "scripts/test.sh: $label collected no tests: failing" >&2
    fi
    [ "$rc" -eq 0 ] || status=1
}

# DeepSpeed compiles a CPU op on first use (about a minute; scripts/setup.sh prebuilds it): each
# environment keeps it in its own cache.
TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}" \
    run "core + TRL" .venv/bin/python "$@"
run "veRL" .venv-verl/bin/python tests/verl
TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv-openrlhf/torch_extensions}" \
    run "OpenRLHF" .venv-openrlhf/bin/python tests/openrlhf
exit "$status"
