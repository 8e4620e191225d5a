#!/usr/bin/env bash
# The wheels bench/gpu_check.sh installs on a GPU machine that reaches no network (CPython 3.12,
# x86-64 Linux, with cupy, numba, numba-cuda, transformers and PyTorch already there): packlora's
# own wheel of this checkout, and what packlora needs that such a machine lacks, with their
# dependencies. numpy is pinned: numba-cuda 0.30.4 fails to import under numpy 2.5.
#
#   bash bench/gpu_wheels.sh [WHEEL_DIR]     (default .whl; then carry it to the machine)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-.whl}"
mkdir -p "$OUT"
rm -f "$OUT"/*.whl  # one version of each: two stop the install there
python3 -m pip wheel -q --no-deps -w "$OUT" .
bash bench/source_hash.sh > "$OUT/SOURCE"  # what gpu_check.sh compares with its checkout
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$OUT" \
    "numpy==2.4.6" pydantic gguf
du -sh "$OUT"
ls "$OUT"
