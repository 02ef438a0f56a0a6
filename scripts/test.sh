#!/usr/bin/env bash
# Run every host's tests, each in its own environment (created by `bash scripts/setup.sh test`):
#   .venv        core, TRL plugin, packaging, examples, benchmarks   (.venv/bin/python -m pytest)
#   .venv-verl       the veRL plugin against real veRL               (tests/verl)
#   .venv-openrlhf   the OpenRLHF plugin against real OpenRLHF       (tests/openrlhf)
#   .venv-trl-vllm   TRL's colocated vLLM engine, stock and forkrl   (tests/trl_vllm)
# Arguments go to both core runs (e.g. -x, -k name; a -m of your own replaces their split). Fails when
# any environment's tests fail or collect nothing.
#
# Core + TRL run first, in two pytest workers (pytest-xdist, a file per worker) of one thread each: their
# models are tiny, and a second intra-op thread makes a test about 6% faster for 40% more CPU time. The
# tests marked `timing` compare measured speeds, which a busy machine skews: they run after, alone, with
# torch's default threads (on a shared machine, `-m "not timing"` leaves them out). The veRL, OpenRLHF and
# TRL + vLLM suites then run side by side (each to its own log, printed when all are done), one thread
# per process as well (three suites on two cores: a second thread spins more than it computes): their
# end-to-end runs spend much of their time starting processes and importing, and none of their tests
# times anything. Each prints its slowest tests (--durations),
# what to look at first when the run grows.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

status=0
run() {  # run LABEL PYTHON ARGS...
    local label="$1" py="$2"
    shift 2
    echo "== $label: $py -m pytest $*"
    "$py" -m pytest --durations=15 "$@"
    local rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "scripts/test.sh: $label collected no tests: failing" >&2
    fi
    return "$rc"
}

# DeepSpeed compiles a CPU op on first use (about a minute; scripts/setup.sh prebuilds it): each
# environment keeps it in its own cache.
core_extensions="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
TORCH_EXTENSIONS_DIR="$core_extensions" OMP_NUM_THREADS=1 \
    run "core + TRL" .venv/bin/python -n 2 --dist loadfile -m "not timing" "$@" || status=1
if [ "$#" -eq 0 ]; then
    TORCH_EXTENSIONS_DIR="$core_extensions" run "core + TRL, timing" .venv/bin/python -m timing || status=1
else  # arguments of your own (-k name) may select no timing test, which is no failure
    echo "== core + TRL, timing: .venv/bin/python -m pytest -m timing $*"
    TORCH_EXTENSIONS_DIR="$core_extensions" .venv/bin/python -m pytest -m timing "$@"
    rc=$?
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1
fi

logs="$(mktemp -d)"
export OMP_NUM_THREADS=1
# One pytest process each: the three keep both cores busy, and a second worker for veRL and OpenRLHF
# made the phase longer, not shorter.
TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv-verl/torch_extensions}" \
    run "veRL" .venv-verl/bin/python tests/verl >"$logs/verl" 2>&1 &
verl=$!
TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv-openrlhf/torch_extensions}" \
    run "OpenRLHF" .venv-openrlhf/bin/python tests/openrlhf >"$logs/openrlhf" 2>&1 &
openrlhf=$!
# A few minutes, mostly starting engines: beside the two above rather than after them.
run "TRL + vLLM" .venv-trl-vllm/bin/python tests/trl_vllm >"$logs/trl_vllm" 2>&1 &
trl_vllm=$!
wait "$verl" || status=1
cat "$logs/verl"
wait "$openrlhf" || status=1
cat "$logs/openrlhf"
wait "$trl_vllm" || status=1
cat "$logs/trl_vllm"
rm -rf "$logs"
exit "$status"
