"""CUDA device helpers on raw bytes: bf16 values and signed bytes, by bit arithmetic. (fp16
values are read through a float16 view of the bytes: decode_k.f16_at.)"""

import math

from numba import cuda, float32, int32


@cuda.jit(device=True, cache=True)
def pow2(e):
    """2**e as an exact float32 for -30 <= e <= 30."""
    if e >= 0:
        return float32(int32(1) << e)
    return float32(1.0) / float32(int32(1) << (-e))


@cuda.jit(device=True, cache=True)
def times_pow2(v, e):
    """v * 2**e in float32 for any int e, in exact steps of at most 2**30."""
    while e > 30:
        v *= pow2(30)
        e -= 30
    while e < -30:
        v *= pow2(-30)
        e += 30
    return v * pow2(e)


@cuda.jit(device=True, cache=True)
def _float_bits(h, mant_bits, exp_max, bias):
    """A 16-bit IEEE-style float (sign at bit 15, then the exponent, then mant_bits of
    mantissa) -> float32: fp16 is (10, 31, 15), bfloat16 (7, 255, 127)."""
    exp = (h >> mant_bits) & exp_max
    mant = h & ((1 << mant_bits) - 1)
    if exp == 0:
        val = times_pow2(float32(mant), 1 - bias - mant_bits)
    elif exp == exp_max:
        val = float32(math.inf) if mant == 0 else float32(math.nan)
    else:
        val = times_pow2(float32((1 << mant_bits) + mant), exp - bias - mant_bits)
    if h & 0x8000:
        return -val
    return val


@cuda.jit(device=True, cache=True)
def bf16_to_float(lo, hi):
    """bfloat16 (little-endian bytes lo, hi) -> float32, by bit arithmetic."""
    return _float_bits(int32(lo) | (int32(hi) << 8), 7, 255, 127)


@cuda.jit(device=True, cache=True)
def signed_byte(v):
    """uint8 -> the int8 with the same bits, as int32."""
    s = int32(v)
    if s >= 128:
        s -= 256
    return s
