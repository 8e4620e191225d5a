"""Large-batch path: decode tiles of W into a bounded scratch and multiply them with BLAS.

Two tilings, both writing each output element in place (blas.gemm, beta = 1 after the first):
- whole rows of W with the full reduction (the forward, while `a` is cache-sized): one BLAS
  call per tile, decoded from contiguous bytes; `a` is re-packed by BLAS per tile (rows too
  long for the cap: blocks of rows by long reduction chunks);
- the output's whole width with the reduction split in chunks that are multiples of BLAS's own
  reduction block: every block of `a` goes through BLAS once, the output is swept once per
  chunk (the backward always: its chunks are whole rows of W).
"""
from numba import get_num_threads

from ...quant.registry import GGML_ROWS, REGISTRY
from .blas import REDUCTION_BLOCK, gemm
from .chunks import LANES
from .decode import decode_tile, decode_tile_par

RC_MIN = 512  # reduction rows per BLAS call below which splitting the width pays instead
# Forward tiles of whole rows of W: at least this many rows per tile (fewer run BLAS too
# narrow: 190 rows of 11008 were 1.24x dense where split chunks were 1.12x; rows that long go
# in blocks of WHOLE_ROWS_MIN rows by reduction chunks of at least ROW_BLOCK_MIN_R values:
# 512 x 4032 1.08-1.13x), while `a` takes at most WHOLE_ROWS_A_MAX bytes (4096x4096, q4_0,
# ÷ dense: M = 256 1.10 vs 1.23 split, M = 512 1.04-1.08 vs 1.09-1.15, M = 1024 even, M = 2048
# 1.08-1.10 vs 1.03-1.04; 4096x11008 at M = 512, 22 MiB of x, still ahead; 2 cores, 32 MiB L3).
WHOLE_ROWS_MIN = 512
ROW_BLOCK_MIN_R = 2048
WHOLE_ROWS_A_MAX = 24 << 20
OUT_ALIGN = 64
# A tile decodes on the calling thread below DECODE_SERIAL_MAX · T / (T - 1) values with T
# threads: the time the threads beyond the first would save must beat a Numba parallel region
# (~0.1 ms) and the threads' contention for memory bandwidth. On 2 cores, between BLAS calls,
# every tile of the default 8 MiB cap decoded faster serially (4096x448: 0.33 vs 0.52 ms).
DECODE_SERIAL_MAX = 5 << 18


def _decoder(elems):
    t = get_num_threads()
    return decode_tile if elems * (t - 1) < DECODE_SERIAL_MAX * t else decode_tile_par


def column_align(K, fmt):
    """Alignment of the columns of W's tiles (format `fmt`): whole blocks of a ggml format,
    whole 32-value chunks of the others keep every tile on the SIMD decoders (rows of other
    lengths take the scalar one, any alignment)."""
    entry = REGISTRY[fmt]
    unit = entry.layout.elems if entry.storage == GGML_ROWS else LANES
    return unit if K % unit == 0 else 1


def _round_down(v, align):
    return max(align, v // align * align)


def _balanced(total, size, align):
    """A chunk size ≤ size (aligned) that splits total into equal-ish chunks."""
    if size >= total:
        return total
    n = -(-total // size)
    return min(size, -(-(-(-total // n)) // align) * align)


def _reduction_chunk(R, limit, align, block):
    """A reduction chunk ≤ limit: a multiple of BLAS's own reduction block where one fits (each
    call then runs whole blocks, as the unsplit product does), else equal-ish aligned chunks."""
    if block:
        step = -(-block // align) * align
        if limit >= step:
            return min(R, limit // step * step)
    return _balanced(R, limit, align)


def plan(P, R, cap_elems, align_p, align_r, block=REDUCTION_BLOCK, m=None):
    """Tile sizes (pc, rc) for out (M, P) = a (M, R) @ B (R, P), B decoded in (rc, pc) tiles of
    at most cap_elems (alignments permitting); block is BLAS's reduction block (None: unknown);
    m is M where out's columns are W's rows (the forward), None where they are not."""
    if P * R <= cap_elems:
        return P, R
    if m is not None and 4 * m * R <= WHOLE_ROWS_A_MAX:
        if cap_elems // R >= WHOLE_ROWS_MIN:
            return _width(P, cap_elems // R, align_p), R
        pc = _width(P, WHOLE_ROWS_MIN, align_p)  # rows too long: blocks of rows, long chunks
        limit = cap_elems // pc // align_r * align_r
        if limit >= ROW_BLOCK_MIN_R:
            return pc, _reduction_chunk(R, limit, align_r, block)
    rc_min = min(R, -(-block // align_r) * align_r if block else RC_MIN)
    rc_full = cap_elems // P // align_r * align_r
    if rc_full >= rc_min:
        return P, _reduction_chunk(R, rc_full, align_r, block)
    rc = min(R, max(align_r, min(rc_min, cap_elems // align_p) // align_r * align_r))
    rc = _reduction_chunk(R, rc, align_r, block)
    return _width(P, cap_elems // rc, align_p), rc


def _width(P, limit, align):
    """Columns of out per tile: ≤ limit, equal-ish, starting on 64-value (cache line and SIMD)
    boundaries where the limit allows (501-wide tiles of y ran ~8% slower than 512-wide)."""
    if limit >= OUT_ALIGN and OUT_ALIGN % align == 0:
        align = OUT_ALIGN
    return _balanced(P, min(P, _round_down(limit, align)), align)


def _product(a, pk, out, scratch, cap_elems, align_p, align_r, transposed):
    """out = a @ B, B = W.T (transposed: out has W's rows as columns) or W, tile by tile."""
    R = a.shape[1]
    P = out.shape[1]
    pc, rc = plan(P, R, cap_elems, align_p, align_r, REDUCTION_BLOCK,
                  a.shape[0] if transposed else None)
    tile = scratch(pc * rc)
    decode = _decoder(pc * rc)
    for p0 in range(0, P, pc):
        p1 = min(P, p0 + pc)
        for r0 in range(0, R, rc):
            r1 = min(R, r0 + rc)
            if transposed:  # B[r0:r1, p0:p1] = W[p0:p1, r0:r1].T
                decode(pk, p0, p1, r0, r1, tile)
                b = tile[: (p1 - p0) * (r1 - r0)].reshape(p1 - p0, r1 - r0).T
            else:
                decode(pk, r0, r1, p0, p1, tile)
                b = tile[: (r1 - r0) * (p1 - p0)].reshape(r1 - r0, p1 - p0)
            gemm(a[:, r0:r1], b, out[:, p0:p1], 0 if r0 == 0 else 1)
    return out


def tiled_fwd(x, pk, N, y, scratch, cap_elems, align):
    """y (M, N) = x (M, K) @ W.T; `align` is the column alignment of W's tiles."""
    return _product(x, pk, y, scratch, cap_elems, 1, align, True)


def tiled_bwd(dy, pk, K, dx, scratch, cap_elems, align):
    """dx (M, K) = dy (M, N) @ W."""
    return _product(dy, pk, dx, scratch, cap_elems, align, 1, False)
