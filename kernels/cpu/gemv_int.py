"""One-row products in integers, for generation: x quantized to 8 bits per chunk of 32 values
(one float scale each, as llama.cpp's Q8_0 activations), then every row of W dotted with it
straight from its packed bytes in integer SIMD (simd_int.py).

Only where the caller allows it (kernels.activations) and the walker takes the weight's format
(simd_int.INT_KINDS): the result differs from the float product by x's rounding, ~0.4% of a
chunk's largest value per element (and nf4 / fp4 by their tables' rounding), so training never
takes this path."""
import numpy as np
from numba import prange

from . import kernel
from .simd_int import XS_STRIDE
from .simd_rows import row_idot

_Q = np.float32(127.0)
_BIG = np.float32(3.4e38)


@kernel()
def quantize_x(x, xq, xs):
    """x (M, K) -> xq (M, K) int8 and xs (M, K // 32 * XS_STRIDE) float32: per chunk of 32,
    dx = max|x| / 127, xq = round(x / dx), then the sums of the quantized values dx * xq over
    lanes 0-15, 16-31 and all (for the formats' min terms: the same x as the codes' products,
    whose roundings then cancel against the min's; x's exact sums err ~2x more). No fastmath,
    here or in a caller: a NaN or inf in x makes its chunk's dx NaN, and the products NaN."""
    M, K = x.shape
    for m in range(M):
        for c in range(K // 32):
            k = 32 * c
            s = c * XS_STRIDE
            amax = np.float32(0.0)
            finite = True
            for j in range(32):
                amax = max(amax, abs(x[m, k + j]))
                finite = finite and np.isfinite(x[m, k + j])
            if not finite:  # no NaN or inf into the float -> int conversion (poison to LLVM)
                xq[m, k:k + 32] = 0
                xs[m, s:s + XS_STRIDE] = np.nan
                continue
            # capped: below ~3.7e-37 127 / amax overflows, and |x * inv| <= 127 still holds
            inv = min(_Q / amax, _BIG) if amax > 0 else np.float32(0.0)
            lo = 0
            hi = 0
            for j in range(32):
                q = np.int8(np.rint(x[m, k + j] * inv))
                xq[m, k + j] = q
                if j < 16:
                    lo += q
                else:
                    hi += q
            dx = amax / _Q
            xs[m, s] = dx
            xs[m, s + 1] = dx * lo
            xs[m, s + 2] = dx * hi
            xs[m, s + 3] = dx * (lo + hi)


@kernel()
def _quantized(x):
    """quantize_x into new buffers. Called from Python, never from a fastmath kernel: Numba
    compiles a callee with its caller's flags, and the NaN checks would fold away."""
    M, K = x.shape
    xq = np.empty((M, K), np.int8)
    xs = np.empty((M, K // 32 * XS_STRIDE), np.float32)
    quantize_x(x, xq, xs)
    return xq, xs


@kernel(inline="always", fastmath=True)
def _rows(pk, xq, xs, n0, n1, y):
    K = pk[3]
    for n in range(n0, n1):
        for m in range(xq.shape[0]):
            y[m, n] = row_idot(pk, n, 0, K, xq[m], xs[m])


@kernel(fastmath=True)
def _fwd_serial(pk, xq, xs, y):
    _rows(pk, xq, xs, 0, y.shape[1], y)


@kernel(parallel=True, fastmath=True)
def _fwd(pk, xq, xs, y, tasks):
    N = y.shape[1]
    chunks = max(1, min(N, tasks))
    for c in prange(chunks):
        _rows(pk, xq, xs, c * N // chunks, (c + 1) * N // chunks, y)


def gemv_int_fwd(x, pk, y, tasks, serial):
    """y (M, N) = x (M, K) @ W.T with x in 8 bits; K a multiple of 32. On the calling thread
    where `serial`, else `tasks` chunks of W's rows spread over the threads."""
    xq, xs = _quantized(x)
    if serial:
        _fwd_serial(pk, xq, xs, y)
    else:
        _fwd(pk, xq, xs, y, tasks)
    return y
