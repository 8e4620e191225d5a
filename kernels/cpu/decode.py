"""Numba decoders: one span of a packed weight's row -> float32, for every format."""
import math

import numpy as np
from numba import njit, prange

# Format families, as ops.pack_args encodes them in pk[0].
BNB4, INT8, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 4

# pk = (family, block_size, double_quant, K, u8, i8, f32, absmax_q, absmax_code, absmax_scale,
#       absmax_offset, pair)
#   u8: nf4/fp4 codes or ggml block bytes; i8: int8 codes or the ggml bytes viewed as int8;
#   f32: absmax (blockwise formats); pair: (256, 2) codebook values of a byte's (high, low) nibble.


@njit(inline="always", fastmath=True, cache=True)
def half_to_float(lo, hi):
    """IEEE fp16 from its two little-endian bytes (subnormals and zero included)."""
    h = np.int32(lo) | (np.int32(hi) << 8)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = m * 5.960464477539063e-08  # 2**-24
    elif e == 31:
        v = math.inf
    else:
        v = math.ldexp(float(m + 1024), e - 25)
    return np.float32(-v if h & 0x8000 else v)


@njit(inline="always", fastmath=True, cache=True)
def block_absmax(pk, b):
    """absmax of block b, undoing the double quantization when the weight has it."""
    if pk[2]:
        return pk[8][pk[7][b]] * pk[9][b >> 8] + pk[10][0]
    return pk[6][b]


@njit(fastmath=True, cache=True)
def _bnb4_segment(codes, pair, s, lo, hi, out, o):
    """Flat elements [lo, hi) of a 4-bit weight (one absmax s) into out[o:]."""
    i = lo
    if i & 1:
        out[o] = pair[codes[i >> 1], 1] * s
        o += 1
        i += 1
    j0 = i >> 1
    for j in range(j0, hi >> 1):
        c = codes[j]
        p = o + 2 * (j - j0)
        out[p] = pair[c, 0] * s
        out[p + 1] = pair[c, 1] * s
    if hi & 1 and hi - 1 >= i:
        out[o + (hi - 1 - i)] = pair[codes[(hi - 1) >> 1], 0] * s


@njit(fastmath=True, cache=True)
def _blockwise_span(pk, start, count, out, o):
    """Flat elements [start, start+count) of an nf4/fp4/int8 weight into out[o:]."""
    bs = pk[1]
    end = start + count
    for b in range(start // bs, (end - 1) // bs + 1):
        lo = max(start, b * bs)
        hi = min(end, (b + 1) * bs)
        s = block_absmax(pk, b)
        if pk[0] == BNB4:
            _bnb4_segment(pk[4], pk[11], s, lo, hi, out, o + lo - start)
        else:
            s = s / np.float32(127.0)
            codes = pk[5]
            base = o - start
            for i in range(lo, hi):
                out[base + i] = codes[i] * s


@njit(fastmath=True, cache=True)
def _ggml_span(pk, n, k0, k1, out, o):
    """Row n, columns [k0, k1) (multiples of 32) of a q4_0/q4_1/q8_0 weight into out[o:]."""
    fam = pk[0]
    u8 = pk[4]
    i8 = pk[5]
    bpb = 18 if fam == Q4_0 else (20 if fam == Q4_1 else 34)
    row = n * (pk[3] // 32) * bpb
    for kb in range(k0 // 32, k1 // 32):
        p = row + kb * bpb
        q = o + (kb * 32 - k0)
        d = half_to_float(u8[p], u8[p + 1])
        if fam == Q8_0:
            for j in range(32):
                out[q + j] = i8[p + 2 + j] * d
        elif fam == Q4_0:
            for j in range(16):
                c = np.int32(u8[p + 2 + j])
                out[q + j] = ((c & 15) - 8) * d
                out[q + j + 16] = ((c >> 4) - 8) * d
        else:
            m = half_to_float(u8[p + 2], u8[p + 3])
            for j in range(16):
                c = np.int32(u8[p + 4 + j])
                out[q + j] = (c & 15) * d + m
                out[q + j + 16] = (c >> 4) * d + m


@njit(fastmath=True, cache=True)
def decode_span(pk, n, k0, k1, out, o):
    """W[n, k0:k1] into out[o:o + k1 - k0]; for ggml formats k0 and k1 are multiples of 32."""
    if pk[0] <= INT8:
        _blockwise_span(pk, n * pk[3] + k0, k1 - k0, out, o)
    else:
        _ggml_span(pk, n, k0, k1, out, o)


@njit(parallel=True, fastmath=True, cache=True)
def decode_tile_par(pk, n0, n1, k0, k1, tile):
    """W[n0:n1, k0:k1] into the flat buffer tile (row-major), rows spread over threads."""
    kc = k1 - k0
    for r in prange(n1 - n0):
        decode_span(pk, n0 + r, k0, k1, tile, r * kc)


@njit(fastmath=True, cache=True)
def decode_tile_ser(pk, n0, n1, k0, k1, tile):
    """W[n0:n1, k0:k1] into the flat buffer tile (row-major), on the calling thread."""
    kc = k1 - k0
    for r in range(n1 - n0):
        decode_span(pk, n0 + r, k0, k1, tile, r * kc)
