"""Tiled fused dequant-GEMM kernel: C = A @ B with B a packed weight decoded tile by tile; a
reduction split over blocks leaves one part of C per block along it, added up in order by the
last block of each tile of C to finish (parts.py), or by the caller."""

import functools
from dataclasses import dataclass

from numba import config, cuda, float32

from .decode import decode_group, decode_run
from .parts import last_to_arrive, tile_adder


@dataclass(frozen=True)
class Tile:
    """Tile shape of one launch: block computes (tm x tc) of C, steps tr along the reduction.

    Each thread owns an (rm x rn) register micro-tile, so a block has
    (tc // rn) x (tm // rm) threads; W is decoded in runs of `seg` consecutive k per thread.
    `blocks`: the blocks a multiprocessor is to hold at once, the kernel's launch bounds
    (ptxas keeps its registers within 65,536 / (threads x blocks)); 0: no bound.
    """

    tm: int = 64
    tc: int = 64
    tr: int = 16
    rm: int = 4
    rn: int = 4
    seg: int = 4
    blocks: int = 0

    def __post_init__(self):
        if self.tm % self.rm or self.tc % self.rn or self.tr % self.seg or self.tc % self.seg:
            raise ValueError(f"Tile {self}: need tm % rm == tc % rn == tr % seg == tc % seg == 0")

    @property
    def block(self):
        """CUDA block shape (x, y)."""
        return (self.tc // self.rn, self.tm // self.rm)


def gemm_kernel(tile):
    """The kernel builder for a Tile: build(fmt, dq) as launch.launch calls it.

    The kernel's arguments: a (M, R) float32; c (Z, M, C) float32 parts, Z the grid's z; out
    (M, C); counts, fold, bwd, span, grp; then the weight's (launch.weight_args), logical W
    (N, kdim).
      fwd (bwd=0): R = kdim, C = N, B[r, col] = W[col, r]  -> sum(c, 0) = a @ W.T
      bwd (bwd=1): R = N, C = kdim, B[r, col] = W[r, col]  -> sum(c, 0) = a @ W
    grp: runs of SEG at multiples of SEG lie inside one scale group (decode.grouped). Block z
    covers reductions [z*span, (z+1)*span), span a multiple of TR (so only the last tile of all
    can pass rdim), and writes c[z]. fold: the last block of a tile of C to finish writes
    out = sum(c, 0) there, in order (counts: a counter a tile, zero before the launch and after
    it, parts.py); else the caller adds the parts."""
    return functools.partial(_build, tile.tm, tile.tc, tile.tr, tile.rm, tile.rn, tile.seg,
                             tile.blocks)


def _bounds(threads, blocks):
    """cuda.jit's launch bounds for `blocks` blocks of `threads` on a multiprocessor at once;
    none for blocks 0, or in the simulator (whose jit takes none)."""
    if not blocks or config.ENABLE_CUDASIM:
        return {}
    return {"launch_bounds": (threads, blocks)}


@functools.cache
def _build(TM, TC, TR, RM, RN, SEG, BLOCKS, fmt, dq):
    """Kernel specialised to compile-time tile sizes and one format (closure constants)."""
    BX = TC // RN
    BY = TM // RM
    NT = BX * BY
    TM_PAD = TM + 1  # padded shared rows: tile loads hit different banks
    TC_PAD = TC + 1
    load_a = _a_loader(TM, TR, NT)
    load_b = _b_loader(TC, TR, SEG, NT, fmt, dq)
    mac = _mac(TR, RM, RN, BX, BY)
    store = _store(RM, RN, BX, BY)
    add_tile = tile_adder(TM, TC, NT)

    # Numba's on-disk cache keys a kernel by bytecode and closure, not launch bounds: the body
    # names BLOCKS, so tiles differing only in `blocks` don't share (and swap) compiled code
    @cuda.jit(cache=True, **_bounds(NT, BLOCKS))
    def packed_gemm(a, c, out, counts, fold, bwd, span, grp, kdim, bs, q, q16, absmax, amq,
                    amcode, amscale, amoff, cb):
        # a (M, R), c (Z, M, C) parts, out (M, C): see gemm_kernel
        if BLOCKS < 0:  # never (a compile-time constant): see above
            return
        a_s = cuda.shared.array(shape=(TR, TM_PAD), dtype=float32)
        b_s = cuda.shared.array(shape=(TR, TC_PAD), dtype=float32)
        acc = cuda.local.array(shape=(RM, RN), dtype=float32)
        am = cuda.local.array(shape=RM, dtype=float32)
        bn = cuda.local.array(shape=RN, dtype=float32)
        mdim, rdim = a.shape
        cdim = c.shape[2]
        ndim = rdim if bwd else cdim
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        tid = ty * BX + tx
        m0, c0 = cuda.blockIdx.y * TM, cuda.blockIdx.x * TC
        for i in range(RM * RN):
            acc[i // RN, i % RN] = float32(0.0)
        rbeg = cuda.blockIdx.z * span
        rend = min(rdim, rbeg + span)
        for r0 in range(rbeg, rend, TR):
            load_a(a, a_s, m0, r0, mdim, rdim, tid)
            load_b(b_s, r0, c0, tid, bwd, grp, ndim, kdim, bs, q, q16, absmax, amq, amcode,
                   amscale, amoff, cb)
            cuda.syncthreads()
            mac(a_s, b_s, acc, am, bn, tx, ty)
            cuda.syncthreads()
        store(c, acc, m0, c0, mdim, cdim, tx, ty)
        if fold:
            slot = cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x
            if last_to_arrive(counts, slot, cuda.gridDim.z, tid):
                add_tile(c, out, m0, c0, mdim, cdim, tid)

    return packed_gemm


@functools.cache
def _a_loader(TM, TR, NT):
    """Device function: a block's (TR x TM) tile of A into shared memory, transposed."""

    @cuda.jit(device=True, cache=True)
    def load_a(a, a_s, m0, r0, mdim, rdim, tid):
        # Consecutive threads read consecutive r (coalesced); past A's edges, zeros.
        for e in range(tid, TR * TM, NT):
            rr = e % TR
            mm = e // TR
            v = float32(0.0)
            if m0 + mm < mdim and r0 + rr < rdim:
                v = a[m0 + mm, r0 + rr]
            a_s[rr, mm] = v

    return load_a


@functools.cache
def _b_loader(TC, TR, SEG, NT, fmt, dq):
    """Device function: a block's (TR x TC) tile of W decoded into shared memory."""

    @cuda.jit(device=True, cache=True)
    def load_b(b_s, r0, c0, tid, bwd, grp, ndim, kdim, bs, q, q16, absmax, amq, amcode, amscale,
               amoff, cb):
        # Decoded in runs of SEG consecutive k (adjacent packed bytes per thread); k runs
        # along r (fwd: b_s[r, c] = W[c, r]) or along c (bwd: b_s[r, c] = W[r, c]).
        for e in range(tid, (TR * TC) // SEG, NT):
            if bwd:
                rr = e // (TC // SEG)
                cc = (e % (TC // SEG)) * SEG
                n = r0 + rr
                k = c0 + cc
            else:
                rr = (e % (TR // SEG)) * SEG
                cc = e // (TR // SEG)
                n = c0 + cc
                k = r0 + rr
            dr = 0 if bwd else 1
            cnt = 0
            if n < ndim:
                cnt = max(0, min(SEG, kdim - k))
            if grp and cnt == SEG:  # a whole run inside one scale group
                decode_group(b_s, rr, cc, dr, 1 - dr, SEG, n, k, kdim, fmt, bs, dq, q, q16,
                             absmax, amq, amcode, amscale, amoff, cb)
            else:
                decode_run(b_s, rr, cc, dr, 1 - dr, cnt, n, k, kdim, fmt, bs, dq, q, q16, absmax,
                           amq, amcode, amscale, amoff, cb)
            for t in range(cnt, SEG):
                b_s[rr + t * dr, cc + t * (1 - dr)] = float32(0.0)

    return load_b


@functools.cache
def _mac(TR, RM, RN, BX, BY):
    """Device function: acc += a_s.T @ b_s on a thread's strided (RM x RN) micro-tile."""

    @cuda.jit(device=True, cache=True)
    def mac(a_s, b_s, acc, am, bn, tx, ty):
        for rr in range(TR):
            for i in range(RM):
                am[i] = a_s[rr, ty + i * BY]
            for j in range(RN):
                bn[j] = b_s[rr, tx + j * BX]
            for i in range(RM):
                for j in range(RN):
                    acc[i, j] += am[i] * bn[j]

    return mac


@functools.cache
def _store(RM, RN, BX, BY):
    """Device function: a thread's micro-tile into c[z] (z: the block's part of the reduction),
    inside c's edges."""

    @cuda.jit(device=True, cache=True)
    def store(c, acc, m0, c0, mdim, cdim, tx, ty):
        z = cuda.blockIdx.z
        for i in range(RM):
            m = m0 + ty + i * BY
            for j in range(RN):
                col = c0 + tx + j * BX
                if m < mdim and col < cdim:
                    c[z, m, col] = acc[i, j]

    return store
