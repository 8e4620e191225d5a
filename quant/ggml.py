"""GGUF/ggml Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 reference codecs: row-wise blocks of 32 with fp16
scales, numpy.

Quantization follows ggml's reference rounding (quantize_row_q*_ref) in float32, so the bytes
equal gguf.quants.quantize. A q4 block is fp16 d (q4_1: then fp16 m) and 16 bytes holding
element j in the low nibble and j+16 in the high one; q5 blocks add 32 high bits (bit j of a
little-endian uint32 is the fifth bit of element j) before the nibbles; q8_0 is fp16 d and 32
int8.
"""
import numpy as np

from .blockwise import check_finite

_F32 = np.float32
CHUNK_ELEMS = 1 << 20
# ggml's GROUP_MAX_EPS: the K-quant and IQ4 encoders treat a sub-block whose largest |x| is below
# this as all zeros (scale 0, every code at the zero point)
GROUP_MAX_EPS = _F32(1e-15)


def _fp16_bytes(x):
    """(..., 1) float32 -> (..., 2) little-endian IEEE half bytes (round to nearest even)."""
    return x.astype("<f2").view(np.uint8)


def fp16_from(blocks, lo):
    """(..., BPB) uint8 -> (..., 1) float32 from the half at bytes [lo, lo+2)."""
    return np.ascontiguousarray(blocks[..., lo:lo + 2]).view("<f2").astype(_F32)


def signed_max(x):
    """(..., n) -> (..., 1): each row's value of largest magnitude, its sign kept (the first of
    equals, as ggml's loops take it)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)


def _inverse(d):
    with np.errstate(divide="ignore"):
        return np.where(d == 0, _F32(0), _F32(1) / d).astype(_F32)


def _pack_nibbles(q):
    """(..., 32) uint8 codes -> (..., 16): element j in the low nibble, j+16 in the high."""
    return q[..., :16] | (q[..., 16:] << np.uint8(4))


def _q4_0(b):
    d = signed_max(b) / _F32(-8)
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


def _high_bits(q):
    """(..., 32) 5-bit codes -> (..., 4) bytes: bit j of the little-endian uint32 is q_j's bit 4."""
    return np.packbits(q >> np.uint8(4), axis=-1, bitorder="little")


def _q5_0(b):
    d = signed_max(b) / _F32(-16)
    q = np.minimum(np.trunc(b * _inverse(d) + _F32(16.5)), 31).astype(np.uint8)
    return np.concatenate([_fp16_bytes(d), _high_bits(q), _pack_nibbles(q & 15)], axis=-1)


def _q5_1(b):
    lo = b.min(axis=-1, keepdims=True)
    d = (b.max(axis=-1, keepdims=True) - lo) / _F32(31)
    q = np.minimum(np.trunc((b - lo) * _inverse(d) + _F32(0.5)), 31).astype(np.uint8)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _high_bits(q), _pack_nibbles(q & 15)],
                          axis=-1)


def _round_half_away(v):
    """C roundf: nearest integer, halves away from zero (exact, no 0.5-add rounding slip)."""
    t = np.trunc(v)
    frac = v - t
    return t + np.where(np.abs(frac) >= _F32(0.5), np.sign(v), _F32(0))


def _q8_0(b):
    d = np.abs(b).max(axis=-1, keepdims=True) / _F32(127)
    q = _round_half_away(b * _inverse(d)).astype(np.int8)
    return np.concatenate([_fp16_bytes(d), q.view(np.uint8)], axis=-1)


def quantize_rows(fmt, array, name, encode):
    """(N, K) float array -> {"blocks": (N, K//B * BPB) uint8}, B and BPB from fmt.layout."""
    n, k = array.shape
    elems, bpb = fmt.layout.elems, fmt.layout.nbytes
    nb = k // elems
    out = np.empty((n, nb * bpb), np.uint8)
    rows = max(1, CHUNK_ELEMS // k)
    for r0 in range(0, n, rows):
        x = np.asarray(array[r0:r0 + rows]).astype(_F32)
        check_finite(x, name, r0 * k)
        blocks = x.reshape(x.shape[0], nb, elems)                  # (r, nb, B)
        out[r0:r0 + rows] = encode(blocks).reshape(x.shape[0], nb * bpb)
    return {"blocks": out}


def dequantize_rows(fmt, buffers, shape, decode):
    """{"blocks": (N, nb*BPB) uint8} -> float32 (N, K)."""
    n, k = shape
    elems, bpb = fmt.layout.elems, fmt.layout.nbytes
    out = np.empty((n, k), _F32)
    rows = max(1, CHUNK_ELEMS // k)
    for r0 in range(0, n, rows):
        raw = np.asarray(buffers["blocks"][r0:r0 + rows]).reshape(-1, k // elems, bpb)
        out[r0:r0 + rows] = decode(raw, fmt.layout).reshape(-1, k)
    return out


def _nibbles(qs):
    """(..., 16) bytes -> (..., 32) codes: element j in the low nibble, j+16 in the high."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _decode_q4_0(blocks, layout):
    """(r, nb, BPB) uint8 -> (r, nb, 32) float32."""
    q = _nibbles(blocks[..., layout.codes_at:])
    return (q.astype(_F32) - _F32(8)) * fp16_from(blocks, layout.scale_at)


def _decode_q4_1(blocks, layout):
    q = _nibbles(blocks[..., layout.codes_at:])
    return q.astype(_F32) * fp16_from(blocks, layout.scale_at) + fp16_from(blocks,
                                                                            layout.min_at)


def _q5_codes(blocks, layout):
    high = np.unpackbits(blocks[..., layout.high_bits_at:layout.high_bits_at + 4], axis=-1,
                         bitorder="little")
    return _nibbles(blocks[..., layout.codes_at:]) | (high << np.uint8(4))


def _decode_q5_0(blocks, layout):
    q = _q5_codes(blocks, layout)
    return (q.astype(_F32) - _F32(16)) * fp16_from(blocks, layout.scale_at)


def _decode_q5_1(blocks, layout):
    q = _q5_codes(blocks, layout)
    return q.astype(_F32) * fp16_from(blocks, layout.scale_at) + fp16_from(blocks, layout.min_at)


def _decode_q8_0(blocks, layout):
    codes = blocks[..., layout.codes_at:].view(np.int8).astype(_F32)
    return codes * fp16_from(blocks, layout.scale_at)


# -- the reference codecs of the registry (quant/registry.py), fmt being the format's entry ----
def row_quantizer(encode):
    """The registry's quantize(fmt, array, block_size, double_quant, name) of an encoder of
    (rows, blocks, B) float32 -> (rows, blocks, BPB) bytes."""
    def quantize(fmt, array, block_size, double_quant, name):
        return quantize_rows(fmt, array, name, encode)
    return quantize


def row_dequantizer(decode):
    """The registry's dequantize(fmt, buffers, shape, block_size) of a block decoder."""
    def dequantize(fmt, buffers, shape, block_size):
        return dequantize_rows(fmt, buffers, shape, decode)
    return dequantize


quantize_q4_0, quantize_q4_1, quantize_q5_0, quantize_q5_1, quantize_q8_0 = (
    row_quantizer(e) for e in (_q4_0, _q4_1, _q5_0, _q5_1, _q8_0))
dequantize_q4_0, dequantize_q4_1, dequantize_q5_0, dequantize_q5_1, dequantize_q8_0 = (
    row_dequantizer(d) for d in (_decode_q4_0, _decode_q4_1, _decode_q5_0, _decode_q5_1,
                                 _decode_q8_0))
