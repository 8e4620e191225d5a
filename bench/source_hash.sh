#!/usr/bin/env bash
# The version of packlora's sources, as 16 hex digits: pyproject.toml and the package's Python
# files. bench/gpu_wheels.sh stamps the wheels it makes with it; bench/gpu_check.sh refuses
# wheels stamped with another (the one GPU call would test code that is not this checkout's).
set -euo pipefail
cd "$(dirname "$0")/.."
cat pyproject.toml $(find src kernels quant adapters -name '*.py' | LC_ALL=C sort) \
    | sha256sum | cut -c1-16
