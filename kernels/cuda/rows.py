"""Decode chosen rows of a packed weight on the GPU (embedding lookups), one launch per call."""
from numba import cuda

from .decode import decode_run
from .ops import _array_module, _weight_args, launch

RUN = 32  # elements one thread decodes; a multiple of the ggml block, so runs stay aligned
THREADS = 128


@cuda.jit(cache=True)
def _gather_kernel(rows, out, kdim, fmt, bs, dq, q, absmax, amq, amcode, amscale, amoff,
                   codebook):
    i = cuda.blockIdx.y
    c0 = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * RUN
    if i < rows.shape[0] and c0 < kdim:
        cnt = min(RUN, kdim - c0)
        decode_run(out, i, c0, 0, 1, cnt, rows[i], c0, kdim, fmt, bs, dq, q, absmax, amq,
                   amcode, amscale, amoff, codebook)


def gather_rows(w, rows, out):
    """out (len(rows), K) = W[rows, :] for a packed weight whose buffers live on the GPU (cupy)
    or, in the simulator, on the host (numpy)."""
    k = int(w.shape[1])
    if rows.size == 0 or k == 0:
        return out
    grid = (-(-k // (RUN * THREADS)), int(rows.size))
    launch(_gather_kernel, grid, THREADS, [rows, out] + _weight_args(w, _array_module(out)),
           result=1)
    return out
