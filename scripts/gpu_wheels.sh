#!/usr/bin/env bash
# Wheels that scripts/gpu_check.py needs on the GPU machine, which has no network. They go to
# build/gpu_wheels/ (ignored by git through build/), and the run carries that folder:
#
#   bash scripts/gpu_wheels.sh                       # here, where pip reaches PyPI (about 2 MB, seconds)
#   run(carry=["build/gpu_wheels"], command="python scripts/gpu_check.py --out $OUT")
#
# gpu_check.py unpacks them into a temporary folder and appends it to sys.path (after what the
# machine has: a package it already holds is never shadowed), so nothing is installed there.
#
# What the machine lacks (its image, read 2026-11-17: torch 2.11, transformers 5.17, accelerate
# 1.15, peft, pyarrow, pandas, huggingface-hub 1.33, fsspec, xxhash, jinja2, psutil, pyyaml, tqdm):
#   prefix-grouper   the Prefix Grouper method (pure Python, no dependencies); pinned as in
#                    pyproject.toml's [bench] extra
#   trl              the trl stage; pinned as in pyproject.toml's [dev] extra. Needs accelerate,
#                    datasets, huggingface_hub, jinja2, numpy, packaging, pandas, psutil, pyarrow,
#                    pyyaml, transformers>=4.56.2: all there but datasets
#   datasets         5.2.0, what TRL 1.16 resolves to here. Needs dill, multiprocess (missing
#                    there) and filelock, numpy, pyarrow>=24, pandas, tqdm, xxhash, fsspec,
#                    huggingface-hub>=1.31, packaging, pyyaml (there; pyarrow's and fsspec's
#                    versions there are unread: gpu_check's env stage prints them, and the trl
#                    stage reports an import failure as its skip reason)
#   dill, multiprocess   datasets' pins (<0.4.2, <0.70.20)
# Every one is a pure-Python wheel (py3-none-any, multiprocess py312-none-any).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-.venv/bin/python}"
dest=build/gpu_wheels

pins=$("$PY" - <<'EOF'
import re, tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
def pin(extra, name):
    for req in extras[extra]:
        if re.fullmatch(rf"{name}==[\w.]+", req.replace(" ", "")):
            return req.replace(" ", "")
    raise SystemExit(f"pyproject.toml's [{extra}] extra pins no {name}==VERSION")
print(pin("bench", "prefix-grouper"), pin("dev", "trl"))
EOF
)

rm -rf "$dest"
mkdir -p "$dest"
# shellcheck disable=SC2086 - $pins is two words on purpose
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" $pins datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19

for whl in "$dest"/*.whl; do
    case "$whl" in
        *-none-any.whl) ;;
        *) echo "gpu_wheels.sh: $whl is not a pure-Python wheel; gpu_check.py only unpacks those" >&2; exit 1 ;;
    esac
done
size=$(du -sk "$dest" | cut -f1)
if [ "$size" -gt $((50 * 1024)) ]; then
    echo "gpu_wheels.sh: $dest holds ${size} KiB, over the 50 MiB meant for a device call" >&2
    exit 1
fi
ls -1 "$dest"
echo "gpu_wheels.sh: ${size} KiB in $dest; carry it: carry=[\"$dest\"]"
