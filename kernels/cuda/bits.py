"""CUDA device helpers on raw bytes: fp16 scales and signed bytes, by bit arithmetic."""

import math

from numba import cuda, float32, int32


@cuda.jit(device=True, cache=True)
def pow2(e):
    """2**e as an exact float32 for -30 <= e <= 30."""
    if e >= 0:
        return float32(int32(1) << e)
    return float32(1.0) / float32(int32(1) << (-e))


@cuda.jit(device=True, cache=True)
def half_to_float(lo, hi):
    """IEEE fp16 (little-endian bytes lo, hi) -> float32, by bit arithmetic."""
    h = int32(lo) | (int32(hi) << 8)
    exp = (h >> 10) & 31
    mant = h & 1023
    if exp == 0:
        val = float32(mant) * pow2(-24)
    elif exp == 31:
        val = float32(math.inf) if mant == 0 else float32(math.nan)
    else:
        val = float32(1024 + mant) * pow2(exp - 25)
    if h & 0x8000:
        return -val
    return val


@cuda.jit(device=True, cache=True)
def signed_byte(v):
    """uint8 -> the int8 with the same bits, as int32."""
    s = int32(v)
    if s >= 128:
        s -= 256
    return s
