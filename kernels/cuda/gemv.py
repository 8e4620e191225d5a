"""Small batches on a GPU (M <= ops.GEMV_MAX_M): the packed bytes of W are read once, coalesced,
and decoded in registers; nothing dense is written.

  forward   y = x @ W.T   a warp per `fwd_shape(rows)[0]` rows of W; its lanes walk K in runs
                          of `fwd_shape(rows)[1]` values, the block's x staged in shared memory
                          a chunk of K at a time (each lane's run in banks of its own), each
                          value of x read there serving all of the warp's rows of W; the warp
                          sums its lanes' dot products (through shared memory, once for all
                          rows of x)
  backward  dx = dy @ W   a thread per run of BWD_SEG columns k, a block per chunk of W's rows;
                          each chunk's partial sums go to a part of their own, added up in
                          order by the last block of the columns to finish (parts.py) or by
                          ops.py (atomic adds would make dx differ between runs)
Every run must be whole and inside one scale group (`fits`: K a multiple of the run, and the
flat formats' block size): each reads its scales once, and its values and the per-row sums stay
in registers (constant trip counts, unrolled); other weights take the tile kernel. Kernels are
built per format (`gemv_fwd(fmt, dq)`, launch.py) and row bound (`row_bound`).
Block sizes are read at run time (cuda.blockDim), so the simulator can launch one warp."""
import functools

from numba import cuda, float32

from .decode import decode_group, grouped
from .parts import last_to_arrive, tile_adder

MAX_M = 16        # rows of x (or dy) a launch takes at most: the per-thread accumulators
SMALL_M = 4       # ... and the bound of the kernels built for the fewest rows (fewer registers)
MAX_WARPS = 8     # warps per block at most (THREADS on a GPU)
THREADS = 32 * MAX_WARPS
FWD_SEG = 8       # consecutive values of a row one lane decodes at a time (forward, M <= 4)
BWD_SEG = 4
# Rows of W a backward thread decodes before it multiplies them (`wrows`): their reads are in
# flight together. One row at a time waits on each row's reads in turn; two keep NF4, FP4,
# INT8, Q4_0, Q8_0, Q2_K, F16 and BF16 within 64 registers on sm_90 (the 512 blocks a launch
# aims for resident at once on 132 multiprocessors), the other formats not. The GPU check
# times both (bench/kernels_cuda.py, gemv_rows2).
BWD_ROWS = 1
# Values of the parts a backward thread adding them has in flight at most: 64 (one part of 16
# rows) took the 16-row kernel past 128 registers on sm_90 (one block a multiprocessor)
ADD_IN_FLIGHT = 32
# The forward for more than SMALL_M rows of x: a warp takes WIDE_W_ROWS rows of W, so that a
# value of x read serves four multiply-adds (one, with a row of W each, left the reads setting
# the pace); its runs are WIDE_SEG long, which keeps the loop fully unrolled (at 8 the
# compiler left it rolled and its 64 sums in local memory).
WIDE_W_ROWS = 4
WIDE_SEG = 4


def fits(block_size, k, bwd):
    """Whether the GEMV takes products with a packed weight of `block_size` and K = k: its runs
    whole and each inside one scale group (the forward's longest runs: the shorter ones then
    fit as well)."""
    return grouped(BWD_SEG if bwd else FWD_SEG, int(block_size), int(k))


def row_bound(m):
    """The `rows` of the kernels that take m rows of x (m <= MAX_M)."""
    return SMALL_M if m <= SMALL_M else MAX_M


def fwd_shape(rows):
    """(rows of W a warp takes, values of a lane's run) of the forward kernel for `rows` rows
    of x."""
    return (1, FWD_SEG) if rows <= SMALL_M else (WIDE_W_ROWS, WIDE_SEG)


@functools.cache
def gemv_fwd(fmt, dq, rows=SMALL_M):
    """The forward kernel for format id fmt (dq: double-quantized absmax), up to `rows` rows."""
    nw, seg = fwd_shape(rows)
    chunk = 32 * seg                # values of K the block's lanes take at a time
    staged = (rows, 32, seg + 1)    # x's chunk by lane and run, padded: lanes in other banks
    run = (nw, seg)                 # local array shapes: compile-time constants
    parts = (MAX_WARPS, rows, 33)   # a lane's sum per row of x, padded: rows in other banks
    accs = rows * nw
    stage = _x_stager(seg)
    write = _warp_sums(rows, nw)

    @cuda.jit(cache=True)
    def kernel(x, y, kdim, bs, q, q16, absmax, amq, amcode, amscale, amoff, cb):
        # x (M, K), y (M, N); warp w of block b computes columns n0 .. n0 + nw - 1 of y,
        # n0 = (b * warps + w) * nw
        tid = cuda.threadIdx.x
        wid = tid >> 5
        lane = tid & 31
        n0 = (cuda.blockIdx.x * (cuda.blockDim.x >> 5) + wid) * nw
        mdim, ndim = x.shape[0], y.shape[1]
        w = cuda.local.array(run, float32)
        acc = cuda.local.array(accs, float32)  # acc[m * nw + r]: row m of x, row n0 + r of W
        dots = cuda.local.array(nw, float32)
        xs = cuda.shared.array(staged, float32)
        part = cuda.shared.array(parts, float32)
        for i in range(accs):
            acc[i] = float32(0.0)
        for k0 in range(0, kdim, chunk):  # every warp, live or not, stages and meets
            stage(x, xs, k0, kdim, mdim, tid)
            cuda.syncthreads()
            k = k0 + lane * seg
            if n0 < ndim and k < kdim:
                for r in range(nw):  # rows past N decode row N - 1 again; their sums go nowhere
                    decode_group(w, r, 0, 0, 1, seg, min(n0 + r, ndim - 1), k, kdim, fmt, bs,
                                 dq, q, q16, absmax, amq, amcode, amscale, amoff, cb)
                for m in range(rows):
                    if m < mdim:
                        for r in range(nw):
                            dots[r] = float32(0.0)
                        for t in range(seg):
                            v = xs[m, lane, t]  # read once for all nw rows of W
                            for r in range(nw):
                                dots[r] += v * w[r, t]
                        for r in range(nw):
                            acc[m * nw + r] += dots[r]
            cuda.syncthreads()
        write(y, acc, part, n0, mdim, ndim, wid, lane)

    return kernel


@functools.cache
def _x_stager(seg):
    """Device function: the block's threads copy x[:, k0 : k0 + 32 * seg] into shared memory,
    coalesced along K, each lane's run of seg values in a padded row of its own."""
    chunk = 32 * seg

    @cuda.jit(device=True, cache=True)
    def stage(x, xs, k0, kdim, mdim, tid):
        for e in range(tid, mdim * chunk, cuda.blockDim.x):
            m = e // chunk
            kk = e - m * chunk
            if k0 + kk < kdim:
                xs[m, kk // seg, kk % seg] = x[m, k0 + kk]

    return stage


@functools.cache
def _warp_sums(rows, nw):
    """Device function: a warp's 32 lane sums for each row of x and of its nw rows of W meet
    in shared memory (part); lane m adds up row m's and writes y[m, n0 + r]."""

    @cuda.jit(device=True, cache=True)
    def write(y, acc, part, n0, mdim, ndim, wid, lane):
        for r in range(nw):
            for m in range(rows):
                part[wid, m, lane] = acc[m * nw + r]
            cuda.syncthreads()
            if n0 + r < ndim and lane < mdim:
                s = float32(0.0)
                for i in range(32):
                    s += part[wid, lane, i]
                y[lane, n0 + r] = s
            cuda.syncthreads()

    return write


@functools.cache
def gemv_bwd(fmt, dq, rows=SMALL_M, *, wrows):
    """The backward kernel for format id fmt (dq: double-quantized absmax), up to `rows` rows
    of dy, `wrows` rows of W decoded at a time (callers pass BWD_ROWS as it is when they call:
    a default would keep the value it had at import)."""
    accs = rows * BWD_SEG
    run = (wrows, BWD_SEG)  # local array shape: a compile-time constant
    add_runs = _run_adder(rows)
    mac = _row_mac(rows)

    @cuda.jit(cache=True)
    def kernel(dy, parts, dx, counts, fold, chunk, kdim, bs, q, q16, absmax, amq, amcode,
               amscale, amoff, cb):
        # dy (M, N), parts (chunks, M, K); block (bx, by): columns from bx * threads * BWD_SEG,
        # W's rows [by * chunk, (by + 1) * chunk), its sums into parts[by]. fold: the last
        # block of column block bx to finish writes dx (M, K) = sum(parts, 0) there, in order
        # (counts: a counter a column block, zero before the launch and after it).
        k = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * BWD_SEG
        mdim = dy.shape[0]
        if k < kdim:  # every thread goes on to count in (last_to_arrive meets the block)
            n0 = cuda.blockIdx.y * chunk
            w = cuda.local.array(run, float32)
            acc = cuda.local.array(accs, float32)
            for i in range(accs):
                acc[i] = float32(0.0)
            nend = min(dy.shape[1], n0 + chunk)
            whole = n0 + (nend - n0) // wrows * wrows
            for nb in range(n0, whole, wrows):  # wrows rows decoded, then multiplied
                for r in range(wrows):
                    decode_group(w, r, 0, 0, 1, BWD_SEG, nb + r, k, kdim, fmt, bs, dq, q, q16,
                                 absmax, amq, amcode, amscale, amoff, cb)
                for r in range(wrows):
                    mac(acc, w, r, dy, nb + r, mdim)
            for n in range(whole, nend):
                decode_group(w, 0, 0, 0, 1, BWD_SEG, n, k, kdim, fmt, bs, dq, q, q16, absmax,
                             amq, amcode, amscale, amoff, cb)
                mac(acc, w, 0, dy, n, mdim)
            for m in range(rows):
                if m < mdim:
                    for t in range(BWD_SEG):
                        parts[cuda.blockIdx.y, m, k + t] = acc[m * BWD_SEG + t]
        if fold and last_to_arrive(counts, cuda.blockIdx.x, cuda.gridDim.y, cuda.threadIdx.x):
            if k < kdim:
                add_runs(parts, dx, k, mdim, kdim)

    return kernel


@functools.cache
def _row_mac(rows):
    """Device function: acc[m * BWD_SEG + t] += dy[m, n] * w[r, t] for the rows m of dy
    (up to `rows`) and a run of BWD_SEG values of W's row n, decoded into w[r]."""

    @cuda.jit(device=True, cache=True)
    def mac(acc, w, r, dy, n, mdim):
        for m in range(rows):
            if m < mdim:
                g = dy[m, n]
                for t in range(BWD_SEG):
                    acc[m * BWD_SEG + t] += g * w[r, t]

    return mac


@functools.cache
def _run_adder(rows):
    """Device function: dx[:, k : k + BWD_SEG] = the sum of its parts, in order, for up to
    `rows` rows, a row at a time: each a tile of one thread (parts.tile_adder), with as many
    reads in flight together as one part of all rows has values, at most ADD_IN_FLIGHT."""
    add_run = tile_adder(1, BWD_SEG, 1, min(rows * BWD_SEG, ADD_IN_FLIGHT))

    @cuda.jit(device=True, cache=True)
    def add(parts, dx, k, mdim, kdim):
        for m in range(rows):
            if m < mdim:
                add_run(parts, dx, m, k, mdim, kdim, 0)

    return add
