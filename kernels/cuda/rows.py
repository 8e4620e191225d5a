"""Decode chosen rows of a packed weight on the GPU (embedding lookups, and the tiles of W that
large batches hand to cuBLAS: tiled.py), one launch per call.

A block decodes RUN * THREADS values of a row. Where runs of SEG values lie inside one scale
group (decode.grouped: every block format, and flat block sizes and rows that SEG divides) a
thread decodes SEG neighbours at a time and reads their scales once; otherwise one value at a
time, THREADS apart. Either way a warp reads and writes neighbouring memory. The rows lie along
the grid's x (up to 2**31 - 1 blocks; y and z stop at 65,535, fewer tokens than one batch of
16 x 4,096 looks up), the blocks of a row along y."""
import functools

from numba import cuda

from .decode import decode_group, decode_run, grouped
from .launch import launch

RUN = 16  # elements one thread decodes
SEG = 8   # ... as runs of SEG neighbours where they share a scale group
THREADS = 256


@functools.cache
def _gather_kernel(fmt, dq):
    """The row gather for format id fmt (dq: double-quantized absmax)."""

    @cuda.jit(cache=True)
    def kernel(rows, out, grp, kdim, bs, q, q16, absmax, amq, amcode, amscale, amoff,
               codebook):
        i = cuda.blockIdx.x
        if i >= rows.shape[0]:
            return
        n = rows[i]
        if grp:
            c = (cuda.blockIdx.y * THREADS * (RUN // SEG) + cuda.threadIdx.x) * SEG
            for _ in range(RUN // SEG):
                if c < kdim:
                    decode_group(out, i, c, 0, 1, SEG, n, c, kdim, fmt, bs, dq, q, q16, absmax,
                                 amq, amcode, amscale, amoff, codebook)
                c += THREADS * SEG
            return
        c = cuda.blockIdx.y * RUN * THREADS + cuda.threadIdx.x
        for _ in range(RUN):
            if c < kdim:
                decode_run(out, i, c, 0, 1, 1, n, c, kdim, fmt, bs, dq, q, q16, absmax, amq,
                           amcode, amscale, amoff, codebook)
            c += THREADS

    return kernel


def gather_rows(w, rows, out):
    """out (len(rows), K) = W[rows, :] for a packed weight whose buffers live on the GPU (cupy)
    or, in the simulator, on the host (numpy)."""
    k = int(w.shape[1])
    if rows.size == 0 or k == 0:
        return out
    grid = (int(rows.size), -(-k // (RUN * THREADS)))
    grp = int(grouped(SEG, int(w.block_size), k))
    launch(_gather_kernel, grid, THREADS, [rows, out, grp], w)
    return out
