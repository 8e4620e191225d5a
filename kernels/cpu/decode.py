"""Numba decoders: one span of a packed weight's row -> float32, for every format."""
import math

import numpy as np
from numba import njit, prange

from .simd import DECODE
from .simd_rows import row_run, simd_span

# Format families, as ops.pack_args encodes them in pk[0].
BNB4, INT8, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 4

# pk = (family, block_size, double_quant, K, u8, i8, f32, absmax_q, absmax_code, absmax_scale,
#       absmax_offset, pair, tab, shift)
#   u8: nf4/fp4 codes or ggml block bytes; i8: int8 codes or the ggml bytes viewed as int8;
#   f32: absmax (blockwise formats); pair: (256, 2) float32 values of a byte's two nibbles: nf4/fp4
#   codebook values (high, low); q4_0/q4_1 integer values (low, high), q4_0 minus 8; tab: the
#   16 nf4/fp4 codebook values (zeros for the other formats); shift: log2(block_size / 32).


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
        v = float((m + 1024) << e) * 2.9802322387695312e-08  # (1024 + m) * 2**(e - 25)
    return np.float32(-v if h & 0x8000 else v)


@njit(inline="always", cache=True)
def _u(i):
    """An index as uint64: Numba then skips its negative-index check, and loops vectorize."""
    return np.uint64(i)


@njit(inline="always", fastmath=True, cache=True)
def _absmax(dq, f32, aq, acode, ascale, aoff, b):
    """absmax of block b, undoing the double quantization when the weight has it."""
    if dq:
        return acode[aq[_u(b)]] * ascale[_u(b >> 8)] + aoff[0]
    return f32[_u(b)]


@njit(inline="always", fastmath=True, cache=True)
def _bnb4_segment(codes, pair, s, lo, hi, out, o):
    """Flat elements [lo, hi) of a 4-bit weight (one absmax s) into out[o:]."""
    i = lo
    if i & 1:
        out[_u(o)] = pair[codes[_u(i >> 1)], 1] * s
        o += 1
        i += 1
    j0 = i >> 1
    for t in range((hi >> 1) - j0):
        c = codes[_u(j0 + t)]
        p = _u(o + 2 * t)
        out[p] = pair[c, 0] * s
        out[p + _u(1)] = pair[c, 1] * s
    if hi & 1 and hi - 1 >= i:
        out[_u(o + hi - 1 - i)] = pair[codes[_u((hi - 1) >> 1)], 0] * s


@njit(fastmath=True, cache=True)
def _blockwise_span(fam, bs, dq, u8, i8, f32, aq, acode, ascale, aoff, pair, start, count, out, o):
    """Flat elements [start, start+count) of an nf4/fp4/int8 weight into out[o:]."""
    end = start + count
    b = start // bs
    lo = start
    while lo < end:
        hi = min(end, (b + 1) * bs)
        s = _absmax(dq, f32, aq, acode, ascale, aoff, b)
        p = o + lo - start
        if fam == BNB4:
            _bnb4_segment(u8, pair, s, lo, hi, out, p)
        else:
            s = s / np.float32(127.0)
            for t in range(hi - lo):
                out[_u(p + t)] = i8[_u(lo + t)] * s
        lo = hi
        b += 1


@njit(fastmath=True, cache=True)
def _q8_0_span(u8, i8, row, kb0, kb1, out, o):
    """Blocks [kb0, kb1) of a q8_0 row starting at byte `row` into out[o:]."""
    for kb in range(kb0, kb1):
        p = row + kb * 34
        q = o + (kb - kb0) * 32
        d = half_to_float(u8[_u(p)], u8[_u(p + 1)])
        for j in range(32):
            out[_u(q + j)] = i8[_u(p + 2 + j)] * d


@njit(fastmath=True, cache=True)
def _q4_span(u8, pair, with_min, row, kb0, kb1, out, o):
    """Blocks [kb0, kb1) of a q4_0 (with_min False) or q4_1 row into out[o:]. pair[c] holds byte
    c's (low, high) nibble values, q4_0's -8 folded in: a table load per value is faster than
    unpacking nibbles in scalar code."""
    bpb = 20 if with_min else 18
    for kb in range(kb0, kb1):
        p = row + kb * bpb
        q = o + (kb - kb0) * 32
        d = half_to_float(u8[_u(p)], u8[_u(p + 1)])
        m = half_to_float(u8[_u(p + 2)], u8[_u(p + 3)]) if with_min else np.float32(0.0)
        p += bpb - 16
        for j in range(16):
            c = u8[_u(p + j)]
            out[_u(q + j)] = pair[c, 0] * d + m
            out[_u(q + j + 16)] = pair[c, 1] * d + m


@njit(fastmath=True, cache=True)
def _ggml_span(fam, K, u8, i8, pair, n, k0, k1, out, o):
    """Row n, columns [k0, k1) (multiples of 32) of a q4_0/q4_1/q8_0 weight into out[o:]."""
    nb = K // 32
    if fam == Q8_0:
        _q8_0_span(u8, i8, n * nb * 34, k0 // 32, k1 // 32, out, o)
    else:
        with_min = fam == Q4_1
        _q4_span(u8, pair, with_min, n * nb * (20 if with_min else 18), k0 // 32, k1 // 32,
                 out, o)


@njit(inline="always", fastmath=True, cache=True)
def decode_span(pk, n, k0, k1, out, o):
    """W[n, k0:k1] into out[o:o + k1 - k0]; for ggml formats k0 and k1 are multiples of 32."""
    fam = pk[0]
    if simd_span(pk[3], k0, k1):
        row_run(DECODE, pk, n, k0, k1, np.float32(1.0), out, o)
    elif fam <= INT8:
        _blockwise_span(fam, pk[1], pk[2], pk[4], pk[5], pk[6], pk[7], pk[8], pk[9], pk[10],
                        pk[11], n * pk[3] + k0, k1 - k0, out, o)
    else:
        _ggml_span(fam, pk[3], pk[4], pk[5], pk[11], n, k0, k1, out, o)


@njit(parallel=True, fastmath=True, cache=True)
def decode_tile_par(pk, n0, n1, k0, k1, tile):
    """W[n0:n1, k0:k1] into the flat buffer tile (row-major), rows spread over threads."""
    kc = k1 - k0
    for r in prange(n1 - n0):
        decode_span(pk, n0 + r, k0, k1, tile, r * kc)


@njit(parallel=True, fastmath=True, cache=True)
def decode_rows_par(pk, rows, tile):
    """W[rows[i], :] into row i of the flat buffer tile, rows spread over threads."""
    K = pk[3]
    for i in prange(rows.shape[0]):
        decode_span(pk, rows[i], 0, K, tile, i * K)
