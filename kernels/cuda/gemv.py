"""Small batches on a GPU (M <= ops.GEMV_MAX_M): the packed bytes of W are read once, coalesced,
and decoded in registers; nothing dense is written.

  forward   y = x @ W.T   one warp per row n of W; its lanes walk K in runs of FWD_SEG values and
                          the warp sums its lanes' dot products (through shared memory)
  backward  dx = dy @ W   a thread per run of BWD_SEG columns k, a block per chunk of W's rows;
                          the chunks' partial sums meet in dx (zeroed) by atomic adds
Block sizes are read at run time (cuda.blockDim), so the simulator can launch one warp."""
from numba import cuda, float32

from .decode import decode_run

MAX_M = 16        # rows of x (or dy) a launch takes: the per-thread accumulators
MAX_WARPS = 8     # warps per block at most (THREADS on a GPU)
THREADS = 32 * MAX_WARPS
FWD_SEG = 8       # consecutive values of a row one lane decodes at a time
BWD_SEG = 4
# local and shared array shapes: compile-time constants for Numba-CUDA
_FWD_RUN, _BWD_RUN, _BWD_ACC, _PARTS = (1, FWD_SEG), (1, BWD_SEG), MAX_M * BWD_SEG, (MAX_WARPS, 32)


@cuda.jit(cache=True)
def gemv_fwd(x, y, kdim, fmt, bs, dq, q, absmax, amq, amcode, amscale, amoff, cb):
    # x (M, K), y (M, N); warp w of block b computes column n = b * warps + w of y
    warps = cuda.blockDim.x >> 5
    wid = cuda.threadIdx.x >> 5
    lane = cuda.threadIdx.x & 31
    n = cuda.blockIdx.x * warps + wid
    mdim = x.shape[0]
    live = n < y.shape[1]
    w = cuda.local.array(_FWD_RUN, float32)
    acc = cuda.local.array(MAX_M, float32)
    part = cuda.shared.array(_PARTS, float32)
    for m in range(MAX_M):
        acc[m] = float32(0.0)
    if live:
        for k in range(lane * FWD_SEG, kdim, 32 * FWD_SEG):
            cnt = min(FWD_SEG, kdim - k)
            decode_run(w, 0, 0, 0, 1, cnt, n, k, kdim, fmt, bs, dq, q, absmax, amq, amcode,
                       amscale, amoff, cb)
            for m in range(mdim):
                s = float32(0.0)
                for t in range(cnt):
                    s += x[m, k + t] * w[0, t]
                acc[m] += s
    for m in range(mdim):
        part[wid, lane] = acc[m]
        cuda.syncthreads()
        if live and lane == 0:
            s = float32(0.0)
            for i in range(32):
                s += part[wid, i]
            y[m, n] = s
        cuda.syncthreads()


@cuda.jit(cache=True)
def gemv_bwd(dy, dx, rows, kdim, fmt, bs, dq, q, absmax, amq, amcode, amscale, amoff, cb):
    # dy (M, N), dx (M, K) zeroed; block (bx, by): columns from bx * threads * BWD_SEG, W's rows
    # [by * rows, (by + 1) * rows)
    k = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * BWD_SEG
    if k >= kdim:
        return
    n0 = cuda.blockIdx.y * rows
    n1 = min(dy.shape[1], n0 + rows)
    mdim = dy.shape[0]
    cnt = min(BWD_SEG, kdim - k)
    w = cuda.local.array(_BWD_RUN, float32)
    acc = cuda.local.array(_BWD_ACC, float32)
    for i in range(_BWD_ACC):
        acc[i] = float32(0.0)
    for n in range(n0, n1):
        decode_run(w, 0, 0, 0, 1, cnt, n, k, kdim, fmt, bs, dq, q, absmax, amq, amcode,
                   amscale, amoff, cb)
        for m in range(mdim):
            g = dy[m, n]
            for t in range(cnt):
                acc[m * BWD_SEG + t] += g * w[0, t]
    for m in range(mdim):
        for t in range(cnt):
            cuda.atomic.add(dx, (m, k + t), acc[m * BWD_SEG + t])
