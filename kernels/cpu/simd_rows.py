"""Row walker over the SIMD runs of simd.py: decode, dot or axpy one span of a packed row.

A span [k0, k1) of a row is one run of 32-value chunks; it needs K, k0 and k1 to be multiples of
32 (`simd_span`), decode.py keeps the scalar path for the rest.
"""
from numba import njit

from . import simd
from .simd import AXPY, DECODE, DOT, I8, Q4_0, Q4_1, Q8_0, TAB4, TAB4DQ

_decode, _dot, _axpy = (simd.make_dispatch(op) for op in (DECODE, DOT, AXPY))

# Format families as decode.py numbers them (pk[0]) and their chunk kinds.
_BNB4, _INT8, _GQ4_0, _GQ4_1 = 0, 1, 2, 3


@njit(inline="always", cache=True)
def simd_span(K, k0, k1):
    """Whether the SIMD walker takes the span [k0, k1) of rows of length K."""
    return K % 32 == 0 and k0 % 32 == 0 and k1 % 32 == 0


@njit(inline="always", cache=True)
def _kind(pk):
    """The chunk kind of a weight. (If-chains: indexing a constant tuple with a runtime value
    cost ~45 ns per row here.)"""
    fam = pk[0]
    if fam == _BNB4:
        return TAB4DQ if pk[2] else TAB4
    if fam == _INT8:
        return I8
    if fam == _GQ4_0:
        return Q4_0
    return Q4_1 if fam == _GQ4_1 else Q8_0


@njit(inline="always", cache=True)
def _bpb(fam):
    """Bytes per ggml block of a family."""
    if fam == _GQ4_0:
        return 18
    return 20 if fam == _GQ4_1 else 34


@njit(inline="always", cache=True)
def _run(op, kind, pk, cb, nch, g0, sh, a, v, vo):
    if op == DECODE:
        return _decode(kind, pk, cb, nch, g0, sh, a, v, vo)
    if op == DOT:
        return _dot(kind, pk, cb, nch, g0, sh, a, v, vo)
    return _axpy(kind, pk, cb, nch, g0, sh, a, v, vo)


@njit(inline="always", fastmath=True, cache=True)
def row_run(op, pk, n, k0, k1, a, v, vo):
    """Apply `op` to W[n, k0:k1] (simd.py): v[vo:] is the decode target, the x row of a dot
    (the dot's value is returned) or the axpy output (scaled by a)."""
    fam = pk[0]
    K = pk[3]
    kind = _kind(pk)
    nch = (k1 - k0) // 32
    if fam >= _GQ4_0:
        cb = (n * (K // 32) + k0 // 32) * _bpb(fam)
        return _run(op, kind, pk, cb, nch, 0, 0, a, v, vo)
    start = n * K + k0
    cb = start // 2 if fam == _BNB4 else start
    return _run(op, kind, pk, cb, nch, start // 32, pk[13], a, v, vo)
