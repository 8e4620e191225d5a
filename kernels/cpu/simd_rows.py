"""Row walker over the SIMD runs of simd.py: decode, dot or axpy one span of a packed row.

A span [k0, k1) of a row is one run of 32-value chunks; it needs K, k0 and k1 to be multiples of
32 (`simd_span`), decode.py keeps the scalar path for the rest.
"""
from numba import njit

from . import simd
from .simd import I8, Q4_0, Q4_1, Q8_0, TAB4, TAB4DQ

_run = simd.make_dispatch()

# Format families as decode.py numbers them (pk[0]) and their chunk kinds.
_BNB4, _GQ4_0 = 0, 2
_BPB = (0, 0, 18, 20, 34)  # bytes per ggml block, by family


@njit(inline="always", cache=True)
def simd_span(K, k0, k1):
    """Whether the SIMD walker takes the span [k0, k1) of rows of length K."""
    return K % 32 == 0 and k0 % 32 == 0 and k1 % 32 == 0


@njit(inline="always", cache=True)
def _kind(pk):
    fam = pk[0]
    if fam == _BNB4:
        return TAB4DQ if pk[2] else TAB4
    return (TAB4, I8, Q4_0, Q4_1, Q8_0)[fam]


@njit(inline="always", fastmath=True, cache=True)
def row_run(op, pk, n, k0, k1, a, v, vo):
    """Apply `op` to W[n, k0:k1] (simd.py): v[vo:] is the decode target, the x row of a dot
    (the dot's value is returned) or the axpy output (scaled by a)."""
    fam = pk[0]
    K = pk[3]
    kind = _kind(pk)
    nch = (k1 - k0) // 32
    if fam >= _GQ4_0:
        cb = (n * (K // 32) + k0 // 32) * _BPB[fam]
        return _run(op, kind, pk, cb, nch, 0, 0, a, v, vo)
    start = n * K + k0
    cb = start // 2 if fam == _BNB4 else start
    return _run(op, kind, pk, cb, nch, start // 32, pk[13], a, v, vo)
