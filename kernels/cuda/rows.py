"""Decode chosen rows of a packed weight on the GPU (embedding lookups), one launch per call."""
import numpy as np
from numba import cuda

from .decode import decode_run
from .ops import _is_cupy, _weight_args

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
    xp = __import__("cupy") if _is_cupy(out) else np
    args = [rows, out] + _weight_args(w, xp)
    if _is_cupy(out):
        import cupy
        stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)
        args = [cuda.as_cuda_array(v, sync=False) if _is_cupy(v) else v for v in args]
        _gather_kernel[grid, THREADS, stream](*args)
        return out
    args = [cuda.to_device(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
            for v in args]
    _gather_kernel[grid, THREADS](*args)
    args[1].copy_to_host(out)
    return out
