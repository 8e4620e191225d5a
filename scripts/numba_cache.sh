# Sourced by test.sh and demo.sh: Numba's compile cache outside the clone, one folder per
# version of the kernel sources. Numba keys its cache on each function's own file, so a kernel
# inlined from a changed file could otherwise come back stale; the format registry (quant/) is
# part of the version, since the kernels bake its layouts and format ids in. Older folders are
# removed.
CACHE="${CACHE:-${PACKLORA_CACHE:-$HOME/.cache/packlora}}"
# the sources are found from this file's place, so sourcing it from another folder neither
# hashes nothing nor removes the real cache as "older"
SOURCES="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KERNELS_HASH=$(cat $(find "$SOURCES/kernels" "$SOURCES/quant" -name '*.py' | sort) | sha256sum \
  | cut -c1-16)
if [ -z "${NUMBA_CACHE_DIR:-}" ]; then
  export NUMBA_CACHE_DIR="$CACHE/numba-$KERNELS_HASH"
  find "$CACHE" -maxdepth 1 -name 'numba*' ! -name "numba-$KERNELS_HASH" -exec rm -rf {} + \
    2>/dev/null || true
fi
