"""16-bit float weights kept in 16 bits: F16 (IEEE half) and BF16 (bfloat16), numpy.

In the registry they are row formats like the ggml ones: a row is a run of 32-value "blocks" of
64 bytes, the little-endian 16-bit values themselves, no scale (the same bytes a GGUF F16 / BF16
tensor stores, viewed as uint8). bfloat16 is the high half of a float32; numpy has no bfloat16,
so its bits travel as uint16.
"""
import numpy as np

from ..errors import QuantError
from .blockwise import check_finite


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 stored as uint16 -> float32 (the bits become the high half)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(a) -> np.ndarray:
    """float32 -> bfloat16 bits as uint16, rounded to nearest even."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _rows_bytes(values16):
    """(N, K) 16-bit array -> (N, 2K) uint8, the bytes as a GGUF file stores them."""
    n = values16.shape[0]
    return np.ascontiguousarray(values16).view(np.uint8).reshape(n, -1)


def quantize_f16(entry, array, block_size, double_quant, name):
    check_finite(array, name)
    half = np.asarray(array, np.float32).astype("<f2")
    if not np.isfinite(half).all():
        raise QuantError(f"tensor {name or '<unnamed>'!r} holds values beyond float16's range "
                         "(±65504); keep it as bf16 or float32")
    return {"blocks": _rows_bytes(half)}


def dequantize_f16(entry, buffers, shape, block_size):
    return np.ascontiguousarray(buffers["blocks"]).view("<f2").astype(np.float32).reshape(shape)


def quantize_bf16(entry, array, block_size, double_quant, name):
    check_finite(array, name)
    return {"blocks": _rows_bytes(float32_to_bf16(array).astype("<u2"))}


def dequantize_bf16(entry, buffers, shape, block_size):
    return bf16_to_float32(np.ascontiguousarray(buffers["blocks"]).view("<u2")).reshape(shape)
