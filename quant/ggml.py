"""GGUF/ggml Q4_0, Q4_1 and Q8_0: row-wise blocks of 32 with fp16 scales, vectorised numpy.

Quantization follows ggml's reference rounding (quantize_row_q*_ref) in float32, so the bytes
equal gguf.quants.quantize. A q4 block is fp16 d (q4_1: then fp16 m) and 16 bytes holding
element j in the low nibble and j+16 in the high one; q8_0 is fp16 d and 32 int8.
"""
import numpy as np

from .blockwise import check_finite
from .formats import GGUF_BLOCK, GGUF_BYTES_PER_BLOCK

_F32 = np.float32
CHUNK_ELEMS = 1 << 20


def _fp16_bytes(x):
    """(..., 1) float32 -> (..., 2) little-endian IEEE half bytes (round to nearest even)."""
    return x.astype("<f2").view(np.uint8)


def _fp16_from(blocks, lo):
    """(..., BPB) uint8 -> (..., 1) float32 from the half at bytes [lo, lo+2)."""
    return np.ascontiguousarray(blocks[..., lo:lo + 2]).view("<f2").astype(_F32)


def _inverse(d):
    with np.errstate(divide="ignore"):
        return np.where(d == 0, _F32(0), _F32(1) / d).astype(_F32)


def _pack_nibbles(q):
    """(..., 32) uint8 codes -> (..., 16): element j in the low nibble, j+16 in the high."""
    return q[..., :16] | (q[..., 16:] << np.uint8(4))


def _q4_0(b):
    amax_at = np.abs(b).argmax(axis=-1)[..., None]
    d = np.take_along_axis(b, amax_at, axis=-1) / _F32(-8)       # signed max / -8
    q = np.trunc(b * _inverse(d) + _F32(8.5))
    q = np.minimum(q, 15).astype(np.uint8)
    return np.concatenate([_fp16_bytes(d), _pack_nibbles(q)], axis=-1)


def _q4_1(b):
    lo = b.min(axis=-1, keepdims=True)
    hi = b.max(axis=-1, keepdims=True)
    d = (hi - lo) / _F32(15)
    q = np.trunc((b - lo) * _inverse(d) + _F32(0.5))
    q = np.minimum(q, 15).astype(np.uint8)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack_nibbles(q)], axis=-1)


def _round_half_away(v):
    """C roundf: nearest integer, halves away from zero (exact, no 0.5-add rounding slip)."""
    t = np.trunc(v)
    frac = v - t
    return t + np.where(np.abs(frac) >= _F32(0.5), np.sign(v), _F32(0))


def _q8_0(b):
    d = np.abs(b).max(axis=-1, keepdims=True) / _F32(127)
    q = _round_half_away(b * _inverse(d)).astype(np.int8)
    return np.concatenate([_fp16_bytes(d), q.view(np.uint8)], axis=-1)


_QUANTIZERS = {"q4_0": _q4_0, "q4_1": _q4_1, "q8_0": _q8_0}


def quantize_ggml(array, fmt, name):
    """(N, K) float array -> {"blocks": (N, K//32 * BPB) uint8}."""
    n, k = array.shape
    nb = k // GGUF_BLOCK
    bpb = GGUF_BYTES_PER_BLOCK[fmt]
    out = np.empty((n, nb * bpb), np.uint8)
    rows = max(1, CHUNK_ELEMS // k)
    for r0 in range(0, n, rows):
        x = np.asarray(array[r0:r0 + rows]).astype(_F32)
        check_finite(x, name, r0 * k)
        blocks = x.reshape(x.shape[0], nb, GGUF_BLOCK)             # (r, nb, 32)
        out[r0:r0 + rows] = _QUANTIZERS[fmt](blocks).reshape(x.shape[0], nb * bpb)
    return {"blocks": out}


def _decode(blocks, fmt):
    """(r, nb, BPB) uint8 -> (r, nb, 32) float32."""
    d = _fp16_from(blocks, 0)
    if fmt == "q8_0":
        return blocks[..., 2:].view(np.int8).astype(_F32) * d
    qs = blocks[..., 4:] if fmt == "q4_1" else blocks[..., 2:]
    q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)
    if fmt == "q4_0":
        return (q.astype(_F32) - _F32(8)) * d
    return q.astype(_F32) * d + _fp16_from(blocks, 2)


def dequantize_ggml(blocks, fmt, shape):
    """(N, nb*BPB) uint8 blocks -> float32 (N, K)."""
    n, k = shape
    nb = k // GGUF_BLOCK
    bpb = GGUF_BYTES_PER_BLOCK[fmt]
    out = np.empty((n, k), _F32)
    rows = max(1, CHUNK_ELEMS // k)
    for r0 in range(0, n, rows):
        raw = np.asarray(blocks[r0:r0 + rows]).reshape(-1, nb, bpb)
        out[r0:r0 + rows] = _decode(raw, fmt).reshape(-1, k)
    return out
