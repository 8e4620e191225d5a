"""Decode chosen rows of a packed weight on the GPU (embedding lookups), one launch per call."""
import functools

from numba import cuda

from .decode import decode_run
from .launch import launch

RUN = 16  # elements one thread decodes, THREADS apart: a warp reads and writes neighbours
THREADS = 256


@functools.cache
def _gather_kernel(fmt, dq):
    """The row gather for format id fmt (dq: double-quantized absmax)."""

    @cuda.jit(cache=True)
    def kernel(rows, out, kdim, bs, q, q16, absmax, amq, amcode, amscale, amoff, codebook):
        i = cuda.blockIdx.y
        if i >= rows.shape[0]:
            return
        c = cuda.blockIdx.x * RUN * THREADS + cuda.threadIdx.x
        for _ in range(RUN):
            if c < kdim:
                decode_run(out, i, c, 0, 1, 1, rows[i], c, kdim, fmt, bs, dq, q, q16, absmax,
                           amq, amcode, amscale, amoff, codebook)
            c += THREADS

    return kernel


def gather_rows(w, rows, out):
    """out (len(rows), K) = W[rows, :] for a packed weight whose buffers live on the GPU (cupy)
    or, in the simulator, on the host (numpy)."""
    k = int(w.shape[1])
    if rows.size == 0 or k == 0:
        return out
    grid = (-(-k // (RUN * THREADS)), int(rows.size))
    launch(_gather_kernel, grid, THREADS, [rows, out], w)
    return out
