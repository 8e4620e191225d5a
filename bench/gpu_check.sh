#!/usr/bin/env bash
# The GPU checks, in one call on a GPU machine: the GPU tests (not the simulator ones), the
# packed kernels against cuBLAS, dropout masks' generator (Philox against XORWOW), and a QLoRA
# step of a SmolLM2-shaped and a 7B-shaped random model (SmolLM2 in float32 and with TF32 tensor
# cores), and last where the SmolLM2 step's host time goes (cProfile). Writes JSON and logs to
# the folder given as $1; each stage runs even if one before it failed, each under its own time
# limit and all within TOTAL_S (585 s, the install included, under a device call's 600): the
# limits add up to 630 s, so a call whose stages run long loses the last ones, the profile
# first, and never a result already written (the tests compile each kernel once per format,
# about a minute of theirs). A device call brings back at most 8 files from its output folder:
# this writes 8 (the GPU's name and package versions head logs.txt), and 8 while a stage runs.
#
#   bash bench/gpu_check.sh OUTDIR [WHEEL_DIR]
#
# WHEEL_DIR (default .whl) holds packlora's wheel and whatever the machine lacks (pydantic,
# gguf, ...), as bench/gpu_wheels.sh makes them: they are installed into /tmp/site with pip
# --no-index, nothing is downloaded. Wheels made from other sources than this checkout's
# (bench/source_hash.sh) are refused before anything runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: bash bench/gpu_check.sh OUTDIR [WHEEL_DIR]}"
WHEELS="${2:-.whl}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Numba's cache in a folder per version of the kernel sources: a warm machine's cache from an
# earlier call would otherwise hand back kernels whose callees changed since
CACHE=/tmp/packlora-cache source scripts/numba_cache.sh
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    SOURCE=$(bash bench/source_hash.sh)
    if [ "$(cat "$WHEELS/SOURCE" 2>/dev/null)" != "$SOURCE" ]; then
        echo "gpu_check: $WHEELS/ holds a packlora wheel not made from this checkout (sources" \
            "$SOURCE): make it again with bash bench/gpu_wheels.sh" >&2
        exit 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
PARTS=$(mktemp -d)
status() { echo "{\"stage\": \"$1\", \"rc\": $2, \"seconds\": $3}" >> "$OUT/stages.jsonl"; }
# All of it, the wheels' install included, ends before a device call's 600 s: a stage gets at
# most what is left, and one with nothing left is recorded as timed out (rc 124) without running
TOTAL_S="${TOTAL_S:-585}"
stage() {  # stage NAME LIMIT_S OUTFILE command...
    local name=$1 limit=$2 file=$3 t0=$SECONDS
    shift 3
    limit=$(( limit < TOTAL_S - SECONDS ? limit : TOTAL_S - SECONDS ))
    if [ "$limit" -le 0 ]; then
        status "$name" 124 0
        echo "== $name: not run, no time left of TOTAL_S=$TOTAL_S" >> "$OUT/logs.txt"
        return
    fi
    # stdout into OUT when the stage ends: a call stopped mid-stage brings back its log instead
    timeout "$limit" "$@" > "$PARTS/$file" 2> "$OUT/stage.log"
    status "$name" $? $((SECONDS - t0))
    mv "$PARTS/$file" "$OUT/$file"
    # the kernels' rows as they finish (about 2 KB each) outlast a stage stopped at its limit
    { echo "== $name"; tail -c 200000 "$OUT/stage.log"; } >> "$OUT/logs.txt"
    rm -f "$OUT/stage.log"
}
{ echo "== gpu"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import cupy, numba, numba_cuda, numpy; print(cupy.__version__, numba.__version__, \
numba_cuda.__version__, numpy.__version__)"; } > "$OUT/logs.txt" 2>&1
# No --maxfail: one failing shared path (dozens of parametrized cases) must not hide the other
# tests' results, and the call cannot be repeated; the stage's time limit bounds it, and short
# tracebacks keep the report within what comes back. One line a test as it ends (-v): a stage
# stopped at its limit still says which tests passed and which failed, and the slowest ten
# (mostly compiles) say how its limit should move
stage tests "${TESTS_S:-175}" tests.txt python3 -m pytest -v -m gpu -p no:cacheprovider -rs \
    --tb=short --durations=10 tests/test_cuda_device.py tests/test_kernels_cuda_gpu.py \
    tests/test_quant.py
stage kernels "${KERNELS_S:-135}" kernels_cuda.json python3 bench/kernels_cuda.py \
    --reps "${REPS:-10}"
stage rng "${RNG_S:-15}" rng_cuda.json python3 bench/gpu_rng.py
stage smollm2 "${SMOL_S:-85}" train_smollm2.json python3 bench/gpu_train_step.py \
    --model smollm2 --out /tmp/gpu-models --precisions float32,tf32
stage llama7b "${LLAMA_S:-180}" train_llama7b.json python3 bench/gpu_train_step.py \
    --model llama7b --out /tmp/gpu-models --layers "${LLAMA_LAYERS:-32}"
stage profile "${PROFILE_S:-40}" profile_smollm2.json python3 bench/gpu_train_step.py \
    --model smollm2 --out /tmp/gpu-models --profile
cat "$OUT/stages.jsonl"
