"""Large batches on a GPU: decode a bounded tile of W's rows into the reused scratch and let
cuBLAS multiply it, tile after tile. No dense copy of the whole W ever exists; the tile is the
device's `dense_scratch` (counted by the memory tracker), the decode a Numba-CUDA kernel.

cuBLAS is column-major: a row-major (R, C) array is its (C, R) transpose with leading dim C.
  forward   y[:, n0:n1] = x @ Wt.T    as  y^T[n0:n1] (nb x M, ld N) = Wt (nb x K) . x^T (K x M)
  backward  dx += dy[:, n0:n1] @ Wt   as  dx^T (K x M, ld K) += Wt^T (K x nb) . dy^T (nb x M)
with Wt = W[n0:n1] (nb, K) decoded into the scratch. Precision is cuBLAS's float32, or TF32 on
tensor cores where cupy's own float32 products use it (Device.set_tf32, CUPY_TF32=1)."""
import numpy as np

from ...device import tf32_enabled
from .rows import gather_rows

try:  # cupy's own cuBLAS binding; without cupy this path is never taken
    from cupy_backends.cuda.api.runtime import CUDA_R_32F
    from cupy_backends.cuda.libs import cublas
except ImportError:
    cublas = None

_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)


def tile_rows(n, k, cap_elems):
    """Rows of W (N, K) decoded per tile: as many as the scratch cap holds, at least one."""
    return max(1, min(n, cap_elems // max(k, 1)))


def scratch_elems(n, k, cap_elems):
    """float32 elements of scratch one tiled product of W (N, K) takes."""
    return tile_rows(n, k, cap_elems) * k


def _gemm(cupy):
    """gemm(transa, transb, m, n, k, A, lda, B, ldb, beta, C, ldc): cuBLAS's float32 GEMM of
    device pointers (C = A.B + beta C, alpha 1) on cupy's handle and current stream (where the
    decode kernels run); on TF32 tensor cores when cupy's float32 compute type says TF32."""
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    compute = (cublas.CUBLAS_COMPUTE_32F_FAST_TF32 if tf32_enabled(cupy)
               else cublas.CUBLAS_COMPUTE_32F)

    def gemm(transa, transb, m, n, k, a, lda, b, ldb, beta, c, ldc):
        cublas.gemmEx(handle, transa, transb, m, n, k, _ONE.ctypes.data, a, CUDA_R_32F, lda,
                      b, CUDA_R_32F, ldb, beta.ctypes.data, c, CUDA_R_32F, ldc, compute,
                      cublas.CUBLAS_GEMM_DEFAULT)
    return gemm


def _tiles(w, cupy, scratch, cap_elems):
    """(n0, n1, decoded rows (n1 - n0, K) as a cupy view of the scratch) for each tile of W."""
    n, k = (int(s) for s in w.shape)
    rows = tile_rows(n, k, cap_elems)
    buf = scratch(rows * k)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        tile = buf[: (n1 - n0) * k].reshape(n1 - n0, k)
        gather_rows(w, cupy.arange(n0, n1, dtype=np.int64), tile)
        yield n0, n1, tile


def fwd(cupy, x, w, y, scratch, cap_elems):
    """y (M, N) = x (M, K) @ W.T, cupy float32, y C-contiguous (x is made so: cuBLAS reads
    it by pointer and leading dimension)."""
    x = cupy.ascontiguousarray(x)
    m, k = x.shape
    n = y.shape[1]
    gemm = _gemm(cupy)
    for n0, n1, tile in _tiles(w, cupy, scratch, cap_elems):
        gemm(cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n1 - n0, m, k, tile.data.ptr, k,
             x.data.ptr, k, _ZERO, y.data.ptr + 4 * n0, n)
    return y


def bwd(cupy, dy, w, dx, scratch, cap_elems):
    """dx (M, K) = dy (M, N) @ W, cupy float32, dx C-contiguous (dy is made so)."""
    dy = cupy.ascontiguousarray(dy)
    m, n = dy.shape
    k = dx.shape[1]
    gemm = _gemm(cupy)
    for n0, n1, tile in _tiles(w, cupy, scratch, cap_elems):
        gemm(cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, k, m, n1 - n0, tile.data.ptr, k,
             dy.data.ptr + 4 * n0, n, _ZERO if n0 == 0 else _ONE, dx.data.ptr, k)
    return dx
