"""Row walker over the SIMD runs of simd.py: decode, dot or axpy one span of a packed row.

A span [k0, k1) of a row is one run of whole blocks of its chunk layout (chunks.py); the layouts
of today's formats are one 32-value chunk per block, so it needs K, k0 and k1 to be multiples of
32 (`simd_span`), decode.py keeps the scalar path for the rest. Everything format-specific comes
in the packed tuple (ops.pack_args), so the walker names no format.
"""

from . import kernel, simd
from .simd import AXPY, DECODE, DOT, I8
from .simd_int import make_int_dot

_decode, _dot, _axpy = (simd.make_dispatch(op) for op in (DECODE, DOT, AXPY))
_idot = make_int_dot()


@kernel(inline="always")
def simd_span(K, k0, k1):
    """Whether the SIMD walker takes the span [k0, k1) of rows of length K."""
    return K % 32 == 0 and k0 % 32 == 0 and k1 % 32 == 0


@kernel(inline="always")
def _run(op, kind, pk, cb, nch, g0, sh, a, v, vo):
    if op == DECODE:
        return _decode(kind, pk, cb, nch, g0, sh, a, v, vo)
    if op == DOT:
        return _dot(kind, pk, cb, nch, g0, sh, a, v, vo)
    return _axpy(kind, pk, cb, nch, g0, sh, a, v, vo)


@kernel(inline="always")
def _span_start(pk, n, k0):
    """(cb, g0, sh) of W[n, k0:]: the byte its first block starts at, and for a flat format the
    absmax block of its first chunk as g0 and chunks -> blocks as a shift (ggml: 0, 0). The
    weight's chunk kind, bytes per block (0: a flat format) and log2 of its values per block
    are pk[14:17]."""
    K = pk[3]
    if pk[15]:  # ggml rows of whole blocks
        return (n * (K >> pk[16]) + (k0 >> pk[16])) * pk[15], 0, 0
    start = n * K + k0
    return (start if pk[14] == I8 else start // 2), start // 32, pk[13]


@kernel(inline="always", fastmath=True)
def row_run(op, pk, n, k0, k1, a, v, vo):
    """Apply `op` to W[n, k0:k1] (simd.py): v[vo:] is the decode target, the x row of a dot
    (the dot's value is returned) or the axpy output (scaled by a)."""
    cb, g0, sh = _span_start(pk, n, k0)
    return _run(op, pk[14], pk, cb, (k1 - k0) // 32, g0, sh, a, v, vo)


@kernel(inline="always", fastmath=True)
def row_idot(pk, n, k0, k1, xq, xs):
    """W[n, k0:k1] . x in integers (simd_int.py): xq and xs hold x's chunks from chunk 0, the
    span's from k0 // 32. Only for the chunk kinds of simd_int.INT_KINDS."""
    cb, g0, sh = _span_start(pk, n, k0)
    return _idot(pk[14], pk, cb, (k1 - k0) // 32, g0, sh, xq, xs, k0 // 32)
