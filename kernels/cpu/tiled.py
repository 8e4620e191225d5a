"""Large-batch path: decode tiles of W into a bounded scratch and multiply them with BLAS.

Each product out (M, P) = a (M, R) @ B (R, P) keeps the output's whole width per tile where the
cap allows and splits the reduction instead, accumulating into `out` in place (blas.gemm with
beta = 1): then every block of `a` goes through BLAS once, instead of being re-packed for every
narrow tile of output columns.
"""
from .blas import gemm
from .decode import decode_tile_par

RC_MIN = 512  # reduction rows per BLAS call below which splitting the width pays instead


def _round_down(v, align):
    return max(align, v // align * align)


def _balanced(total, size, align):
    """A chunk size ≤ size (aligned) that splits total into equal-ish chunks."""
    if size >= total:
        return total
    n = -(-total // size)
    return min(size, -(-(-(-total // n)) // align) * align)


def plan(P, R, cap_elems, align_p, align_r):
    """Tile sizes (pc, rc) for out (M, P) = a (M, R) @ B (R, P), B decoded in (rc, pc) tiles of
    at most cap_elems (alignments permitting)."""
    if P * R <= cap_elems:
        return P, R
    rc_full = cap_elems // P // align_r * align_r
    if rc_full >= min(R, RC_MIN):
        return P, _balanced(R, rc_full, align_r)
    rc = min(R, max(align_r, min(RC_MIN, cap_elems // align_p) // align_r * align_r))
    rc = _balanced(R, rc, align_r)
    return _balanced(P, min(P, _round_down(cap_elems // rc, align_p)), align_p), rc


def _product(a, pk, out, scratch, cap_elems, align_p, align_r, transposed):
    """out = a @ B, B = W.T (transposed: out has W's rows as columns) or W, tile by tile."""
    R = a.shape[1]
    P = out.shape[1]
    pc, rc = plan(P, R, cap_elems, align_p, align_r)
    tile = scratch(pc * rc)
    for p0 in range(0, P, pc):
        p1 = min(P, p0 + pc)
        for r0 in range(0, R, rc):
            r1 = min(R, r0 + rc)
            if transposed:  # B[r0:r1, p0:p1] = W[p0:p1, r0:r1].T
                decode_tile_par(pk, p0, p1, r0, r1, tile)
                b = tile[: (p1 - p0) * (r1 - r0)].reshape(p1 - p0, r1 - r0).T
            else:
                decode_tile_par(pk, r0, r1, p0, p1, tile)
                b = tile[: (r1 - r0) * (p1 - p0)].reshape(r1 - r0, p1 - p0)
            gemm(a[:, r0:r1], b, out[:, p0:p1], 0 if r0 == 0 else 1)
    return out


def tiled_fwd(x, pk, N, y, scratch, cap_elems, align):
    """y (M, N) = x (M, K) @ W.T; `align` is the column alignment of W's tiles."""
    return _product(x, pk, y, scratch, cap_elems, 1, align, True)


def tiled_bwd(dy, pk, K, dx, scratch, cap_elems, align):
    """dx (M, K) = dy (M, N) @ W."""
    return _product(dy, pk, dx, scratch, cap_elems, align, 1, False)
