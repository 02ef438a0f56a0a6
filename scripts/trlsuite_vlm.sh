#!/usr/bin/env bash
# TRL's own VLM tests (TestGRPOTrainerVLM, TestRLOOTrainerVLM) in the offline harness of ../shared/trl_suite,
# with the tiny VLMs and zen-image datasets that scripts/trlsuite_vlm.py builds.
# usage: TRL_GIT=<git dir of huggingface/trl> scripts/trlsuite_vlm.sh stock|tree [extra pytest args]
# env:   TRLSUITE_DIR (default ./trlsuite-vlm-work), PYTHON, TRL_REV, TRLSUITE_TIMEOUT as for run.sh
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
HARNESS=${TRLSUITE_HARNESS:-$ROOT/../shared/trl_suite}
MODE=${1:-stock}; shift || true
export TRLSUITE_DIR=${TRLSUITE_DIR:-$PWD/trlsuite-vlm-work}
export PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
export PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"
bash "$HARNESS/run.sh" "$MODE" -p trlsuite_vlm -k VLM "$@"
