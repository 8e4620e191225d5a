"""IQ4_NL / IQ4_XS's per-sub-block scale search (quant/iquant_encode.py's fit_scales), compiled:
one 32-value sub-block per iteration of a parallel loop, summed in float32 in ggml's order
(quantize_row_iq4_nl_impl without an importance matrix, weights x^2).

Each candidate inverse scale maps the sub-block onto the table (codebooks.IQ4_CODE) by a
bisection over its 16 values, as ggml's best_index_int8; the numpy reference sums pairwise, so a
near tie between candidates can go the other way on a fraction of a percent of sub-blocks.
"""
import numpy as np
from numba import prange

from ...quant.codebooks import IQ4_CODE
from ...quant.ggml import GROUP_MAX_EPS
from ...quant.iquant_encode import NTRY
from . import kernel
from .kquant_search import largest_magnitude

_F32 = np.float32


@kernel()
def _nearest(table, v):
    """The table value nearest v, ties going up (ggml's best_index_int8 over a sorted table)."""
    if v <= table[0]:
        return table[0]
    if v >= table[-1]:
        return table[-1]
    lo, hi = 0, table.size - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if v < table[mid]:
            hi = mid
        else:
            lo = mid
    return table[hi - 1] if v - table[hi - 1] < table[hi] - v else table[hi]


@kernel()
def _sums(table, x, inv):
    """(sum w q x, sum w q^2) with w = x^2 of the codes nearest x * inv."""
    sqx, sq2 = _F32(0), _F32(0)
    for i in range(x.size):
        q = _nearest(table, inv * x[i])
        w = x[i] * x[i]
        sqx += w * q * x[i]
        sq2 += w * q * q
    return sqx, sq2


@kernel()
def _scale_one(table, x):
    """One sub-block's scale (0 for an all-zero one)."""
    top = largest_magnitude(x)
    if abs(top) < GROUP_MAX_EPS:
        return _F32(0)
    sqx, sq2 = _sums(table, x, _F32(1) / (-top / table[0]))
    d = sqx / sq2 if sq2 > 0 else _F32(0)
    best = d * sqx
    for step in range(-NTRY, NTRY + 1):
        sqx, sq2 = _sums(table, x, (_F32(step) + table[0]) / top)
        if sq2 > 0 and sqx * sqx > best * sq2:
            d = sqx / sq2
            best = d * sqx
    return d


@kernel(parallel=True)
def _fit_scales(table, x, out):
    for s in prange(x.shape[0]):
        out[s] = _scale_one(table, x[s])


def fit_scales(x):
    """x (S, 32) float32 -> (S,) float32 scale of each sub-block: quant.iquant_encode.fit_scales,
    compiled."""
    out = np.empty(x.shape[0], _F32)
    _fit_scales(IQ4_CODE, np.ascontiguousarray(x, _F32), out)
    return out
