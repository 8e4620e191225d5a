"""Small-batch kernels on the SIMD walkers: W's rows are dotted or accumulated straight from their
packed bytes, never written out as floats. They need K to be a multiple of 32 (simd_rows).

Below PARALLEL_MIN (forward) or PARALLEL_MIN_BWD weights x rows a call stays on one thread, where
a parallel region costs more than it saves. Measured on 2 cores with Numba's OpenMP layer (Q4_1,
M = 1, serial / parallel): 192x576 9 / 15 us backward, 576x576 29 / 24 us forward and 26 / 25
backward, 1536x576 76 / 52 forward and 88 / 66 backward (the backward's per-thread accumulators
are summed at the end). On the workqueue layer every parallel call costs ~0.1 ms more: there
WORKQUEUE_MIN holds for both (576x1536 at M = 1: 0.1 ms serial, 0.13 ms parallel)."""
import numpy as np
from numba import prange

from . import cheap_regions, kernel
from .fused import sum_parts
from .simd import AXPY, DOT
from .simd_rows import row_run

PARALLEL_MIN = 1 << 18
PARALLEL_MIN_BWD = 1 << 19
WORKQUEUE_MIN = 1 << 23
_ONE = np.float32(1.0)


def serial(work, bwd):
    """Whether `work` weights x rows of a forward (or backward) call stay on one thread."""
    if not cheap_regions():
        return work < WORKQUEUE_MIN
    return work < (PARALLEL_MIN_BWD if bwd else PARALLEL_MIN)


@kernel(inline="always", fastmath=True)
def _dot_rows(xf, pk, M, K, n0, n1, y):
    for n in range(n0, n1):
        for m in range(M):
            y[m, n] = row_run(DOT, pk, n, 0, K, _ONE, xf, m * K)


@kernel(fastmath=True)
def gemv_fwd_serial(x, pk, y):
    """y (M, N) = x (M, K) @ W.T on the calling thread."""
    M, K = x.shape
    _dot_rows(x.reshape(-1), pk, M, K, 0, y.shape[1], y)


@kernel(parallel=True, fastmath=True)
def gemv_fwd(x, pk, y, tasks):
    """y (M, N) = x (M, K) @ W.T; `tasks` chunks of W's rows spread over the threads."""
    M, K = x.shape
    N = y.shape[1]
    xf = x.reshape(-1)
    chunks = max(1, min(N, tasks))
    for c in prange(chunks):
        _dot_rows(xf, pk, M, K, c * N // chunks, (c + 1) * N // chunks, y)


@kernel(inline="always", fastmath=True)
def _axpy_rows(dy, pk, K, n0, n1, acc):
    """acc (M * K) += dy[:, n0:n1] @ W[n0:n1]."""
    for n in range(n0, n1):
        for m in range(dy.shape[0]):
            row_run(AXPY, pk, n, 0, K, dy[m, n], acc, m * K)


@kernel(fastmath=True)
def gemv_bwd_serial(dy, pk, dx):
    """dx (M, K) = dy (M, N) @ W on the calling thread."""
    dx[:] = 0.0
    _axpy_rows(dy, pk, dx.shape[1], 0, dy.shape[1], dx.reshape(-1))


@kernel(parallel=True, fastmath=True)
def gemv_bwd(dy, pk, dx, tasks):
    """dx (M, K) = dy (M, N) @ W; `tasks` chunks of W's rows, each into its own accumulator,
    summed at the end (tasks x M x K floats)."""
    M, N = dy.shape
    K = dx.shape[1]
    chunks = max(1, min(N, tasks))
    part = np.zeros((chunks, M, K), np.float32)
    for c in prange(chunks):
        _axpy_rows(dy, pk, K, c * N // chunks, (c + 1) * N // chunks, part[c].reshape(-1))
    sum_parts(part, dx)
