"""CUDA packed linear ops: y = x @ W.T and dx = dy @ W with W kept packed (fused dequant-GEMM)."""

import functools

import numpy as np
from numba import config

from ...quant.packed import array_module
from ..format_ids import checked_format, wrong_device
from . import gemv, tiled
from .decode import grouped
from .gemm import Tile, gemm_kernel
from .launch import counters, is_cupy, launch, zero

SIM_TILE = Tile(tm=8, tc=16, tr=16, rm=4, rn=4, seg=8)  # 8 threads: fast in the simulator
SMALL_M_TILE = Tile(tm=16, tc=64, tr=32, rm=1, rn=4, seg=8)  # 256 threads, M <= 16
LARGE_M_TILE = Tile(tm=64, tc=64, tr=16, rm=4, rn=4, seg=4)  # 256 threads
# Tiles the GPU check times against SMALL_M_TILE at 4 < M <= 16 (bench/kernels_cuda.py): 4 x 4
# register tiles, two shared-memory reads per four multiply-adds where SMALL_M_TILE's 1 x 4 has
# five, 64 or 128 threads a block; and SMALL_M_TILE held to three blocks a multiprocessor (80
# registers on sm_90, where unbounded NF4 + DQ, Q4_0 and Q4_K take 88-95, two blocks; Q4_0,
# Q4_1, Q5_0 and Q5_1 then spill 8-16 bytes).
SMALL_M_CANDIDATES = {"tile_4x4_64": Tile(tm=16, tc=64, tr=32, rm=4, rn=4, seg=8),
                      "tile_4x4_128": Tile(tm=16, tc=128, tr=32, rm=4, rn=4, seg=8),
                      "tile_3_blocks": Tile(tm=16, tc=64, tr=32, rm=1, rn=4, seg=8, blocks=3)}
# Rows of x up to which the GEMV kernels (gemv.py) read W's packed bytes once; measured on an
# H200 they beat the fused tile at M = 1 and lose to it at M = 16.
GEMV_MAX_M = 4
# Up to this many rows the fused kernels run; above it (on cupy arrays, with a scratch) a
# decoded tile of W goes to cuBLAS (tiled.py), without a scratch the fused dequant-GEMM.
FUSED_MAX_M = 16
assert GEMV_MAX_M <= gemv.MAX_M
# Blocks a launch aims for (a few per multiprocessor): thin products split the reduction.
TARGET_BLOCKS = 512
# GEMV threads a block in the simulator: one warp is fast there (a test runs the GPU's)
SIM_GEMV_THREADS = 32
# A reduction split over blocks: the last block of each output tile adds the parts (parts.py),
# in the product's one launch; off: a cupy (or numpy) sum along the parts after it (the GPU
# check times both).
SUM_PARTS_IN_KERNEL = True


def linear_fwd(x, w, out=None, *, tile=None, scratch=None, cap_elems=0):
    """y (M, N) = x (M, K) @ W.T for a PackedWeight w of logical shape (N, K). With `scratch`
    (a getter of reused float32 buffers, at most cap_elems) large M goes through cuBLAS."""
    n, k = _weight_shape(w)
    _check_input(x, k, "x", "linear_fwd", f"in_features K={k}")
    y = _output(x, out, (x.shape[0], n), "linear_fwd")
    if _tiled(x, y, w, tile, scratch):
        return tiled.fwd(array_module(x), x, w, y, scratch, cap_elems)
    _launch(x, y, w, bwd=0, tile=tile, scratch=scratch, cap_elems=cap_elems)
    return y


def linear_bwd(dy, w, out=None, *, tile=None, scratch=None, cap_elems=0):
    """dx (M, K) = dy (M, N) @ W for a PackedWeight w of logical shape (N, K)."""
    n, k = _weight_shape(w)
    _check_input(dy, n, "dy", "linear_bwd", f"out_features N={n}")
    dx = _output(dy, out, (dy.shape[0], k), "linear_bwd")
    if _tiled(dy, dx, w, tile, scratch):
        return tiled.bwd(array_module(dy), dy, w, dx, scratch, cap_elems)
    _launch(dy, dx, w, bwd=1, tile=tile, scratch=scratch, cap_elems=cap_elems)
    return dx


def _tiled(a, c, w, tile, scratch):
    """Whether a product goes through decoded tiles and cuBLAS (cupy, M > FUSED_MAX_M)."""
    return (scratch is not None and tile is None and is_cupy(a) and a.shape[0] > FUSED_MAX_M
            and a.shape[1] > 0 and c.shape[1] > 0)


def _weight_shape(w):
    checked_format(w)  # known format, 2-D, buffers as the registry lays them out
    n, k = (int(s) for s in w.shape)
    return n, k


def _check_input(a, width, name, op, what):
    if a.ndim != 2 or a.shape[1] != width:
        raise ValueError(f"{op}: {name} must be (M, {width}) to match the weight's {what}, "
                         f"got shape {tuple(a.shape)}")
    if a.dtype != np.float32:
        raise ValueError(f"{op}: {name} must be float32, got {a.dtype}")


def _output(a, out, shape, op):
    """The result array: `out` if given (checked), else new from a's array module."""
    if out is None:
        return array_module(a).empty(shape, dtype=np.float32)
    if tuple(out.shape) != shape or out.dtype != np.float32:
        raise ValueError(f"{op}: out must be float32 {shape}, got {out.dtype} {tuple(out.shape)}")
    if is_cupy(out) != is_cupy(a) or not out.flags.c_contiguous:
        raise ValueError(f"{op}: out must be a C-contiguous array of the same array module as "
                         f"the input ({type(a).__module__})")
    return out


def _default_tile(m):
    if config.ENABLE_CUDASIM:
        return SIM_TILE
    return SMALL_M_TILE if m <= FUSED_MAX_M else LARGE_M_TILE


def _launch(a, c, w, bwd, tile, scratch=None, cap_elems=0):
    """Launch the packed GEMV (M <= GEMV_MAX_M, no tile asked for, whole runs: gemv.fits) or
    GEMM kernel for c = a @ (W.T if fwd else W). A reduction split over blocks leaves a part
    per block (in the scratch where there is one, as many as cap_elems holds when given),
    added up in a fixed order (in the kernel, or here): the same inputs give the same bits on
    every run, which atomic adds into c would not."""
    if is_cupy(next(iter(w.buffers.values()))) != is_cupy(a):
        raise wrong_device(w, is_cupy(a))
    m, cdim = c.shape
    if m == 0 or cdim == 0:
        return
    if a.shape[1] == 0:
        zero(c)
        return
    most = _most_parts(m, cdim, cap_elems)
    if tile is None and _gemv_takes(m, w.block_size, w.shape[1], bwd):
        _launch_gemv(a, c, w, bwd, scratch, most)
        return
    tile = tile or _default_tile(m)
    grid, span = _tile_grid(m, cdim, a.shape[1], tile, most)
    grp = int(grouped(tile.seg, int(w.block_size), int(w.shape[1])))
    _split_launch(gemm_kernel(tile), grid, tile.block, w, a, c, scratch, grid[2],
                  grid[0] * grid[1], [bwd, span, grp])


def _launch_gemv(a, c, w, bwd, scratch, most):
    threads = _gemv_threads()
    bound = gemv.row_bound(a.shape[0])
    if not bwd:  # a warp per gemv.fwd_shape(bound)[0] rows of W
        build = functools.partial(gemv.gemv_fwd, rows=bound)
        per_block = (threads // 32) * gemv.fwd_shape(bound)[0]
        launch(build, (_cdiv(c.shape[1], per_block),), threads, [a, c], w)
        return
    grid, rows = _gemv_bwd_grid(a.shape[1], c.shape[1], threads, most)
    build = functools.partial(gemv.gemv_bwd, rows=bound, wrows=gemv.BWD_ROWS)
    _split_launch(build, grid, threads, w, a, c, scratch, grid[1], grid[0], [rows])


def _gemv_takes(m, block_size, k, bwd):
    """Whether a product of m rows with a packed W (N, k) of `block_size` takes the GEMV
    kernels (unless a tile is asked for)."""
    return m <= GEMV_MAX_M and gemv.fits(block_size, k, bwd)


def _gemv_threads():
    return SIM_GEMV_THREADS if config.ENABLE_CUDASIM else gemv.THREADS


def _most_parts(m, cdim, cap_elems):
    """Parts of an (m, cdim) output the scratch cap holds (at least 1: the output itself);
    without a cap (0) as many as the grid wants."""
    return max(1, cap_elems // max(m * cdim, 1)) if cap_elems else TARGET_BLOCKS


def _gemv_bwd_grid(n, k, threads, most=TARGET_BLOCKS):
    """((column blocks, row chunks), W's rows a chunk) of the GEMV backward for W (N, K), at
    most `most` chunks (each a part)."""
    cols = _cdiv(k, threads * gemv.BWD_SEG)
    rows = _cdiv(n, min(n, _cdiv(TARGET_BLOCKS, cols), most))
    return (cols, _cdiv(n, rows)), rows


def _tile_grid(m, cdim, rdim, tile, most=TARGET_BLOCKS):
    """(grid, span) of the tile kernel: C's tiles along x and y, the reduction's parts of
    `span` along z (at most `most`)."""
    grid = (_cdiv(cdim, tile.tc), _cdiv(m, tile.tm))
    span = _reduction_span(rdim, grid[0] * grid[1], tile.tr, most)
    return (*grid, _cdiv(rdim, span)), span


def _parts(c, n, scratch):
    """(n, M, C) float32 for the n parts of c (M, C) the blocks write: c itself when n is 1."""
    if n == 1:
        return c.reshape(1, *c.shape)
    if scratch is not None and is_cupy(c):
        return scratch(n * c.size).reshape(n, *c.shape)
    return array_module(c).empty((n, *c.shape), np.float32)


def _split_launch(build, grid, block, w, a, c, scratch, nparts, tiles, tail):
    """Launch build's kernel on (a, parts, c, counters, fold, *tail) for c = a @ W with the
    reduction split into nparts parts over `tiles` output tiles: the last block of each tile
    adds its parts (fold, parts.py), or a sum after the launch does."""
    parts = _parts(c, nparts, scratch)
    fold = int(nparts > 1 and SUM_PARTS_IN_KERNEL)
    counts = counters(array_module(c), tiles if fold else 1)
    launch(build, grid, block, [a, parts, c, counts, fold, *tail], w, result=2 if fold else 1)
    if not fold:
        _add_parts(parts, c)


def _add_parts(parts, c):
    """c = the parts' sum along their first axis: cupy's (or numpy's) reduction, whose order of
    additions is fixed by the shapes, so the same on every call."""
    if parts.shape[0] > 1:
        array_module(c).sum(parts, axis=0, out=c)


def parts_elems(m, n, k, block_size, bwd, cap_elems=0):
    """float32 elements of scratch the partial sums of a fused product take: M rows (at most
    FUSED_MAX_M) with a packed W (N, K) of `block_size`, forward or backward, under a scratch
    cap of cap_elems (0: none) (0: one part)."""
    cdim, rdim = (k, n) if bwd else (n, k)
    most = _most_parts(m, cdim, cap_elems)
    if _gemv_takes(m, block_size, k, bwd):
        parts = _gemv_bwd_grid(n, k, _gemv_threads(), most)[0][1] if bwd else 1
    else:
        parts = _tile_grid(m, cdim, rdim, _default_tile(m), most)[0][2]
    return parts * m * cdim if parts > 1 else 0


def _reduction_span(rdim, blocks, tr, most=TARGET_BLOCKS):
    """Reduction length per block: all of it, or a multiple of tr that gives ~TARGET_BLOCKS
    blocks (and at most `most` parts) when the output alone gives too few (small M on a wide
    GPU)."""
    if blocks >= TARGET_BLOCKS or most <= 1:
        return max(rdim, 1)
    splits = min(_cdiv(TARGET_BLOCKS, blocks), max(1, rdim // (2 * tr)), most)
    return _cdiv(_cdiv(rdim, splits), tr) * tr


def _cdiv(a, b):
    return -(-a // b)
