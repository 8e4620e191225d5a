"""Small batches on a GPU (M <= ops.GEMV_MAX_M): the packed bytes of W are read once, coalesced,
and decoded in registers; nothing dense is written.

  forward   y = x @ W.T   one warp per row n of W; its lanes walk K in runs of FWD_SEG values and
                          the warp sums its lanes' dot products (through shared memory, once for
                          all rows of x)
  backward  dx = dy @ W   a thread per run of BWD_SEG columns k, a block per chunk of W's rows;
                          the chunks' partial sums meet in dx (zeroed) by atomic adds
Every run must be whole and inside one scale group (`fits`: K a multiple of the run, and the
flat formats' block size): each reads its scales once, and its values and the per-row sums stay
in registers (constant trip counts, unrolled); other weights take the tile kernel. Kernels are
built per format (`gemv_fwd(fmt, dq)`, launch.py) and row bound (`row_bound`).
Block sizes are read at run time (cuda.blockDim), so the simulator can launch one warp."""
import functools

from numba import cuda, float32

from .decode import decode_group, grouped

MAX_M = 16        # rows of x (or dy) a launch takes at most: the per-thread accumulators
SMALL_M = 4       # ... and the bound of the kernels built for the fewest rows (fewer registers)
MAX_WARPS = 8     # warps per block at most (THREADS on a GPU)
THREADS = 32 * MAX_WARPS
FWD_SEG = 8       # consecutive values of a row one lane decodes at a time
BWD_SEG = 4
_FWD_RUN, _BWD_RUN = (1, FWD_SEG), (1, BWD_SEG)  # local array shapes: compile-time constants


def fits(w, bwd):
    """Whether the GEMV takes products with packed weight w: its runs whole and each inside
    one scale group."""
    return grouped(BWD_SEG if bwd else FWD_SEG, int(w.block_size), int(w.shape[1]))


def row_bound(m):
    """The `rows` of the kernels that take m rows of x (m <= MAX_M)."""
    return SMALL_M if m <= SMALL_M else MAX_M


@functools.cache
def gemv_fwd(fmt, dq, rows=SMALL_M):
    """The forward kernel for format id fmt (dq: double-quantized absmax), up to `rows` rows."""
    parts = (MAX_WARPS, rows, 33)  # a lane's sum per row of x, padded: rows fall in other banks

    @cuda.jit(cache=True)
    def kernel(x, y, kdim, bs, q, q16, absmax, amq, amcode, amscale, amoff, cb):
        # x (M, K), y (M, N); warp w of block b computes column n = b * warps + w of y
        warps = cuda.blockDim.x >> 5
        wid = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        n = cuda.blockIdx.x * warps + wid
        mdim = x.shape[0]
        live = n < y.shape[1]
        w = cuda.local.array(_FWD_RUN, float32)
        acc = cuda.local.array(rows, float32)
        part = cuda.shared.array(parts, float32)
        for m in range(rows):
            acc[m] = float32(0.0)
        if live:
            for k in range(lane * FWD_SEG, kdim, 32 * FWD_SEG):
                decode_group(w, 0, 0, 0, 1, FWD_SEG, n, k, kdim, fmt, bs, dq, q, q16, absmax,
                             amq, amcode, amscale, amoff, cb)
                for m in range(rows):
                    if m < mdim:
                        s = float32(0.0)
                        for t in range(FWD_SEG):
                            s += x[m, k + t] * w[0, t]
                        acc[m] += s
        for m in range(rows):
            part[wid, m, lane] = acc[m]
        cuda.syncthreads()
        if live and lane < mdim:  # lane m sums row m's 32 parts
            s = float32(0.0)
            for i in range(32):
                s += part[wid, lane, i]
            y[lane, n] = s

    return kernel


@functools.cache
def gemv_bwd(fmt, dq, rows=SMALL_M):
    """The backward kernel for format id fmt (dq: double-quantized absmax), up to `rows` rows."""
    accs = rows * BWD_SEG

    @cuda.jit(cache=True)
    def kernel(dy, dx, chunk, kdim, bs, q, q16, absmax, amq, amcode, amscale, amoff, cb):
        # dy (M, N), dx (M, K) zeroed; block (bx, by): columns from bx * threads * BWD_SEG, W's
        # rows [by * chunk, (by + 1) * chunk)
        k = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * BWD_SEG
        if k >= kdim:
            return
        n0 = cuda.blockIdx.y * chunk
        n1 = min(dy.shape[1], n0 + chunk)
        mdim = dy.shape[0]
        w = cuda.local.array(_BWD_RUN, float32)
        acc = cuda.local.array(accs, float32)
        for i in range(accs):
            acc[i] = float32(0.0)
        for n in range(n0, n1):
            decode_group(w, 0, 0, 0, 1, BWD_SEG, n, k, kdim, fmt, bs, dq, q, q16, absmax, amq,
                         amcode, amscale, amoff, cb)
            for m in range(rows):
                if m < mdim:
                    g = dy[m, n]
                    for t in range(BWD_SEG):
                        acc[m * BWD_SEG + t] += g * w[0, t]
        for m in range(rows):
            if m < mdim:
                for t in range(BWD_SEG):
                    cuda.atomic.add(dx, (m, k + t), acc[m * BWD_SEG + t])

    return kernel
