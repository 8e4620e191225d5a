"""Numba decoders: one span of a packed weight's row -> float32, for every format."""
import numpy as np
from numba import njit, prange

from .simd import DECODE
from .simd_rows import row_run, simd_span

# Format families, as ops.pack_args encodes them in pk[0].
BNB4, INT8, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 4

# pk = (family, block_size, double_quant, K, u8, i8, f32, absmax_q, absmax_code, absmax_scale,
#       absmax_offset, pair, tab, shift)
#   u8: nf4/fp4 codes or ggml block bytes; i8: int8 codes; f32: absmax (blockwise formats);
#   pair: (256, 2) float32 nf4/fp4 codebook values of a byte's (high, low) nibbles, for the scalar
#   decoder; tab: the 16 nf4/fp4 codebook values, for the SIMD one (zeros for the other formats);
#   shift: log2(block_size / 32).


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


@njit(inline="always", fastmath=True, cache=True)
def decode_span(pk, n, k0, k1, out, o):
    """W[n, k0:k1] into out[o:o + k1 - k0] with the SIMD walker; spans it cannot take (K, k0 or
    k1 not a multiple of 32: blockwise formats only, ggml rows are whole 32-blocks and callers
    keep their spans aligned) go through the scalar blockwise decoder."""
    if simd_span(pk[3], k0, k1):
        row_run(DECODE, pk, n, k0, k1, np.float32(1.0), out, o)
    else:
        _blockwise_span(pk[0], pk[1], pk[2], pk[4], pk[5], pk[6], pk[7], pk[8], pk[9], pk[10],
                        pk[11], n * pk[3] + k0, k1 - k0, out, o)


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
