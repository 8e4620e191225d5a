"""Large-batch path: decode tiles of W into a bounded scratch and multiply them with BLAS."""
import numpy as np

from .decode import decode_tile_par


def _round_down(v, align):
    return max(align, v // align * align)


def plan(M, P, R, cap_elems, align_p, align_r):
    """Tile sizes (mc, pc, rc) for out (M, P) = a (M, R) @ B (R, P), B decoded in (rc, pc) tiles.

    One tile spans the whole reduction (rc = R) when pc columns of it fit the cap; otherwise the
    reduction is split and each partial product goes through an (mc, pc) buffer in the scratch.
    """
    if R * align_p <= cap_elems:
        pc = min(P, _round_down(cap_elems // R, align_p))
        return M, pc, R
    pc = min(P, align_p)
    half = cap_elems // 2
    rc = min(R, _round_down(half // pc, align_r))
    mc = min(M, max(1, half // pc))
    return mc, pc, rc


def _matmul_into(a, b, dst, part, first):
    """dst = a @ b when first, else dst += a @ b through the scratch `part`."""
    if first:
        np.matmul(a, b, out=dst)
        return
    tmp = part[: dst.size].reshape(dst.shape)
    np.matmul(a, b, out=tmp)
    np.add(dst, tmp, out=dst)


def tiled_fwd(x, pk, N, y, scratch, cap_elems, align):
    """y (M, N) = x (M, K) @ W.T with W decoded a row tile at a time."""
    M, K = x.shape
    mc, nc, kc = plan(M, N, K, cap_elems, 1, align)
    buf = scratch(nc * kc + (mc * nc if kc < K else 0))
    tile, part = buf[: nc * kc], buf[nc * kc:]
    for n0 in range(0, N, nc):
        n1 = min(N, n0 + nc)
        for k0 in range(0, K, kc):
            k1 = min(K, k0 + kc)
            decode_tile_par(pk, n0, n1, k0, k1, tile)
            t = tile[: (n1 - n0) * (k1 - k0)].reshape(n1 - n0, k1 - k0)  # (nc, kc)
            for m0 in range(0, M, mc):
                m1 = min(M, m0 + mc)
                _matmul_into(x[m0:m1, k0:k1], t.T, y[m0:m1, n0:n1], part, k0 == 0)
    return y


def tiled_bwd(dy, pk, K, dx, scratch, cap_elems, align):
    """dx (M, K) = dy (M, N) @ W with W decoded a column tile at a time."""
    M, N = dy.shape
    mc, kc, nc = plan(M, K, N, cap_elems, align, 1)
    buf = scratch(nc * kc + (mc * kc if nc < N else 0))
    tile, part = buf[: nc * kc], buf[nc * kc:]
    for k0 in range(0, K, kc):
        k1 = min(K, k0 + kc)
        for n0 in range(0, N, nc):
            n1 = min(N, n0 + nc)
            decode_tile_par(pk, n0, n1, k0, k1, tile)
            t = tile[: (n1 - n0) * (k1 - k0)].reshape(n1 - n0, k1 - k0)  # (nc, kc)
            for m0 in range(0, M, mc):
                m1 = min(M, m0 + mc)
                _matmul_into(dy[m0:m1, n0:n1], t, dx[m0:m1, k0:k1], part, n0 == 0)
    return dx
