"""Numba decoders: runs of a packed weight's rows (a span of each) -> float32, for every format."""
import numpy as np
from numba import prange

from ..format_ids import INT8
from . import kernel
from .prefetch import prefetch_bytes
from .simd import DECODE
from .simd_rows import row_run, simd_span

# Runs of rows a parallel tile decode is cut into (a few per thread on any machine; reading
# get_num_threads() inside a kernel would stop Numba from caching it).
TILE_CHUNKS = 64

# pk = (format id (format_ids.py), block_size, double_quant, K, u8, i8, f32, absmax_q,
#       absmax_code, absmax_scale, absmax_offset, pair, tab, shift, kind, block_bytes,
#       block_shift)
#   u8: nf4/fp4 codes or ggml block bytes; i8: int8 codes; f32: absmax (blockwise formats);
#   pair: (256, 2) float32 nf4/fp4 codebook values of a byte's (high, low) nibbles, for the scalar
#   decoder; tab: the 16 nf4/fp4/IQ4 codebook values, for the SIMD one (zeros for the others);
#   shift: log2(block_size / 32); kind: the SIMD chunk kind (simd.py); block_bytes: bytes per
#   ggml block (0 for the flat formats); block_shift: log2(block_size).


@kernel(inline="always")
def _u(i):
    """An index as uint64: Numba then skips its negative-index check, and loops vectorize."""
    return np.uint64(i)


@kernel(inline="always", fastmath=True)
def _absmax(dq, f32, aq, acode, ascale, aoff, b):
    """absmax of block b, undoing the double quantization when the weight has it."""
    if dq:
        return acode[aq[_u(b)]] * ascale[_u(b >> 8)] + aoff[0]
    return f32[_u(b)]


@kernel(inline="always", fastmath=True)
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


@kernel(fastmath=True)
def _blockwise_span(pk, start, count, out, o):
    """Flat elements [start, start+count) of an nf4/fp4/int8 weight into out[o:]. Takes the
    whole tuple: unpacking its arrays at the call site, inside the callers' row loops, cost
    ~40 ns per row even where this branch is not taken."""
    fid, bs, dq, u8, i8, f32, aq, acode, ascale, aoff, pair = (
        pk[0], pk[1], pk[2], pk[4], pk[5], pk[6], pk[7], pk[8], pk[9], pk[10], pk[11])
    end = start + count
    b = start // bs
    lo = start
    while lo < end:
        hi = min(end, (b + 1) * bs)
        s = _absmax(dq, f32, aq, acode, ascale, aoff, b)
        p = o + lo - start
        if fid != INT8:
            _bnb4_segment(u8, pair, s, lo, hi, out, p)
        else:
            s = s / np.float32(127.0)
            for t in range(hi - lo):
                out[_u(p + t)] = i8[_u(lo + t)] * s
        lo = hi
        b += 1


@kernel(inline="always")
def _prefetch_span(pk, n, k0, k1):
    """Prefetch the packed bytes of W[n, k0:k1] (the codes; scales of flat formats are few)."""
    K = pk[3]
    if pk[15]:  # ggml rows of whole blocks
        lo = (n * (K >> pk[16]) + (k0 >> pk[16])) * pk[15]
        prefetch_bytes(pk[4], lo, lo + ((k1 - k0) >> pk[16]) * pk[15])
    elif pk[0] == INT8:
        prefetch_bytes(pk[5], n * K + k0, n * K + k1)
    else:
        prefetch_bytes(pk[4], (n * K + k0) >> 1, (n * K + k1 + 1) >> 1)


@kernel(inline="always", fastmath=True)
def decode_rows(pk, n0, n1, k0, k1, out, o):
    """W[n0:n1, k0:k1] into out[o:] (row-major, rows k1 - k0 apart) with the SIMD walker; spans
    it cannot take (K, k0 or k1 not a multiple of 32: blockwise formats only, ggml rows are whole
    32-blocks and callers keep their spans aligned) go through the scalar blockwise decoder.
    Callers hand over runs of rows, not single rows: each inlined call copies the packed tuple
    (reference counts of its arrays), ~40 ns, the time of decoding ~200 values."""
    kc = k1 - k0
    ahead = kc < pk[3]  # a stretch of each row: ask for the next row's bytes (prefetch.py)
    if simd_span(pk[3], k0, k1):
        for r in range(n1 - n0):
            if ahead and r + 1 < n1 - n0:
                _prefetch_span(pk, n0 + r + 1, k0, k1)
            row_run(DECODE, pk, n0 + r, k0, k1, np.float32(1.0), out, o + r * kc)
    else:
        for r in range(n1 - n0):
            _blockwise_span(pk, (n0 + r) * pk[3] + k0, kc, out, o + r * kc)


@kernel(parallel=True, fastmath=True)
def decode_tile_par(pk, n0, n1, k0, k1, tile):
    """W[n0:n1, k0:k1] into the flat buffer tile (row-major), runs of rows spread over threads."""
    kc = k1 - k0
    rows = n1 - n0
    chunks = min(rows, TILE_CHUNKS)
    for c in prange(chunks):
        r0 = c * rows // chunks
        decode_rows(pk, n0 + r0, n0 + (c + 1) * rows // chunks, k0, k1, tile, r0 * kc)


@kernel(parallel=True, fastmath=True)
def decode_rows_par(pk, rows, tile):
    """W[rows[i], :] into row i of the flat buffer tile, rows spread over threads."""
    K = pk[3]
    if simd_span(K, 0, K):
        for i in prange(rows.shape[0]):
            row_run(DECODE, pk, rows[i], 0, K, np.float32(1.0), tile, i * K)
    else:
        for i in prange(rows.shape[0]):
            _blockwise_span(pk, rows[i] * K, K, tile, i * K)


@kernel(fastmath=True)
def decode_tile(pk, n0, n1, k0, k1, tile):
    """decode_tile_par on the calling thread (small tiles: a parallel region costs more)."""
    decode_rows(pk, n0, n1, k0, k1, tile, 0)
