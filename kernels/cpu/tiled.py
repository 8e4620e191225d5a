"""Large-batch path: decode tiles of W into a bounded scratch and multiply them with BLAS.

Each product out (M, P) = a (M, R) @ B (R, P) keeps the output's whole width per tile where the
cap allows and splits the reduction instead, accumulating into `out` in place (blas.gemm with
beta = 1): then every block of `a` goes through BLAS once, instead of being re-packed for every
narrow tile of output columns.
"""
from numba import get_num_threads

from .blas import REDUCTION_BLOCK, gemm
from .decode import decode_tile, decode_tile_par

RC_MIN = 512  # reduction rows per BLAS call below which splitting the width pays instead
# Decoding runs at ~10^10 values/s per core and a Numba parallel region costs ~0.1 ms (2-core
# machines measured): a tile decodes on the calling thread unless the threads beyond the first
# would save more than that, i.e. below DECODE_SERIAL_MAX · T / (T - 1) values with T threads.
DECODE_SERIAL_MAX = 1 << 20


def _decoder(elems):
    t = get_num_threads()
    return decode_tile if elems * (t - 1) < DECODE_SERIAL_MAX * t else decode_tile_par


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


def plan(P, R, cap_elems, align_p, align_r, block=REDUCTION_BLOCK):
    """Tile sizes (pc, rc) for out (M, P) = a (M, R) @ B (R, P), B decoded in (rc, pc) tiles of
    at most cap_elems (alignments permitting); block is BLAS's reduction block (None: unknown)."""
    if P * R <= cap_elems:
        return P, R
    rc_min = min(R, -(-block // align_r) * align_r if block else RC_MIN)
    rc_full = cap_elems // P // align_r * align_r
    if rc_full >= rc_min:
        return P, _reduction_chunk(R, rc_full, align_r, block)
    rc = min(R, max(align_r, min(rc_min, cap_elems // align_p) // align_r * align_r))
    rc = _reduction_chunk(R, rc, align_r, block)
    return _balanced(P, min(P, _round_down(cap_elems // rc, align_p)), align_p), rc


def _product(a, pk, out, scratch, cap_elems, align_p, align_r, transposed):
    """out = a @ B, B = W.T (transposed: out has W's rows as columns) or W, tile by tile."""
    R = a.shape[1]
    P = out.shape[1]
    pc, rc = plan(P, R, cap_elems, align_p, align_r, REDUCTION_BLOCK)
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
