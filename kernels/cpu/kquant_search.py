"""The K-quant encoders' per-sub-block searches (quant/kquant_encode.py), compiled: one sub-block
per iteration of a parallel loop, each summed in float32 in ggml's order (quantize_row_q*_K_ref).

Each function has the signature and results of its numpy reference: fit_scale_min (Q2_K, Q4_K,
Q5_K), fit_q3_scale (Q3_K), fit_signed_scale (Q6_K). The numpy ones sum a sub-block pairwise,
these in sequence as ggml does, so a near tie between two candidate grids can go the other way:
the bytes agree with the reference's (and llama.cpp's) on all but a fraction of a percent.
"""
import numpy as np
from numba import prange

from ...quant.ggml import GROUP_MAX_EPS
from ...quant.kquant_encode import Searches
from . import kernel

_F32 = np.float32


@kernel()
def _grid(x, mn, iscale, nmax, out):
    """out = clip(rint(iscale (x - mn)), 0, nmax): one candidate grid of a sub-block."""
    for i in range(x.size):
        out[i] = min(max(np.rint(iscale * (x[i] - mn)), _F32(0)), nmax)


@kernel()
def _error(x, w, scale, q, mn, mad):
    """The weighted error of x ~ scale q + mn, absolute (mad) or squared, summed in order."""
    err = _F32(0)
    for i in range(x.size):
        diff = scale * q[i] + mn - x[i]
        err += w[i] * (abs(diff) if mad else diff * diff)
    return err


@kernel()
def _fit_scale_min_one(x, w, nmax, rmin, rdelta, nstep, mad, q, cand):
    """One sub-block of fit_scale_min: its codes into q, -> (scale, min)."""
    top, lo, sum_w, sum_x = x[0], x[0], _F32(0), _F32(0)
    for i in range(x.size):
        top, lo = max(top, x[i]), min(lo, x[i])
        sum_w += w[i]
        sum_x += w[i] * x[i]
    mn = min(lo, _F32(0))
    if top == mn:                                   # flat: every code 0
        q[:] = 0
        return _F32(0), -mn
    iscale = nmax / (top - mn)
    scale = _F32(1) / iscale
    _grid(x, mn, iscale, nmax, q)
    best = _error(x, w, scale, q, mn, mad)
    for step in range(nstep + 1):                   # each grid starts at the best min so far
        span = top - mn
        iscale = (rmin + rdelta * _F32(step) + nmax) / (span if span > 0 else _F32(1))
        _grid(x, mn, iscale, nmax, cand)
        sum_l, sum_l2, sum_xl = _F32(0), _F32(0), _F32(0)
        for i in range(x.size):
            sum_l += w[i] * cand[i]
            sum_l2 += w[i] * cand[i] * cand[i]
            sum_xl += w[i] * cand[i] * x[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > 0:
                this_scale, this_min = sum_xl / sum_l2, _F32(0)   # det > 0: sum_l2 > 0
            err = _error(x, w, this_scale, cand, this_min, mad)
            if err < best:
                q[:] = cand
                best, scale, mn = err, this_scale, this_min
    return scale, -mn


@kernel(parallel=True)
def _fit_scale_min(x, w, nmax, rmin, rdelta, nstep, mad, scale, mins, q, cand):
    for s in prange(x.shape[0]):
        scale[s], mins[s] = _fit_scale_min_one(x[s], w[s], nmax, rmin, rdelta, nstep, mad, q[s],
                                               cand[s])


def fit_scale_min(x, w, nmax, rmin, rdelta, nstep, mad=False):
    """x, w (S, n) float32 -> scale (S,), min (S,) >= 0, codes (S, n) in [0, nmax] as float32:
    quant.kquant_encode.fit_scale_min, compiled."""
    s = x.shape[0]
    scale, mins, q = np.empty(s, _F32), np.empty(s, _F32), np.empty(x.shape, _F32)
    _fit_scale_min(np.ascontiguousarray(x, _F32), np.ascontiguousarray(w, _F32), _F32(nmax),
                   _F32(rmin), _F32(rdelta), nstep, bool(mad), scale, mins, q, np.empty_like(q))
    return scale, mins, q


@kernel()
def largest_magnitude(x):
    """The value of largest magnitude, the first of equals."""
    top = x[0]
    for i in range(1, x.size):
        if abs(x[i]) > abs(top):
            top = x[i]
    return top


@kernel()
def _signed_sums(x, iscale, nmax, out):
    """Codes of x at iscale into out, -> (sum w x q, sum w q^2) with w = x^2."""
    sumlx, suml2 = _F32(0), _F32(0)
    for i in range(x.size):
        out[i] = min(max(np.rint(iscale * x[i]), -nmax), nmax - 1)
        wi = x[i] * x[i]
        sumlx += wi * x[i] * out[i]
        suml2 += wi * out[i] * out[i]
    return sumlx, suml2


@kernel()
def _q3_one(x, nmax, q):
    """One sub-block of fit_q3_scale: its codes into q (all 0 for an all-zero one), -> scale."""
    top = largest_magnitude(x)
    if abs(top) < GROUP_MAX_EPS:
        q[:] = 0
        return _F32(0)
    sumlx, suml2 = _signed_sums(x, -nmax / top, nmax, q)
    for _ in range(5):
        changed = False
        for i in range(x.size):
            wi, li = x[i] * x[i], q[i]
            slx = sumlx - wi * x[i] * li
            if slx > 0:
                sl2 = suml2 - wi * li * li
                new = min(max(np.rint(x[i] * sl2 / slx), -nmax), nmax - 1)
                if new != li:
                    slx += wi * x[i] * new
                    sl2 += wi * new * new
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        q[i], sumlx, suml2, changed = new, slx, sl2, True
        if not changed:
            break
    for i in range(x.size):
        q[i] += nmax
    return sumlx / suml2 if suml2 > 0 else _F32(0)


@kernel(parallel=True)
def _fit_q3_scale(x, nmax, scale, q):
    for s in prange(x.shape[0]):
        scale[s] = _q3_one(x[s], nmax, q[s])


def fit_q3_scale(x, nmax):
    """x (S, n) float32 -> scale (S,), codes (S, n) in [0, 2 nmax) as float32:
    quant.kquant_encode.fit_q3_scale, compiled (all-zero rows: scale 0, codes 0)."""
    scale, q = np.empty(x.shape[0], _F32), np.empty(x.shape, _F32)
    _fit_q3_scale(np.ascontiguousarray(x, _F32), _F32(nmax), scale, q)
    return scale, q


@kernel()
def _signed_one(x, nmax, q, cand):
    """One sub-block of fit_signed_scale: its signed codes into q, -> scale."""
    top = largest_magnitude(x)
    if abs(top) < GROUP_MAX_EPS:
        q[:] = 0
        return _F32(0)
    sumlx, suml2 = _signed_sums(x, -nmax / top, nmax, q)
    scale = sumlx / suml2 if suml2 > 0 else _F32(0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        sx, s2 = _signed_sums(x, -(nmax + _F32(0.1) * _F32(step)) / top, nmax, cand)
        if s2 > 0 and sx * sx > best * s2:
            q[:] = cand
            scale = sx / s2
            best = scale * sx
    return scale


@kernel(parallel=True)
def _fit_signed_scale(x, nmax, scale, q, cand):
    for s in prange(x.shape[0]):
        scale[s] = _signed_one(x[s], nmax, q[s], cand[s])


def fit_signed_scale(x, nmax):
    """x (S, n) float32 -> scale (S,), signed codes (S, n) in [-nmax, nmax) as float32:
    quant.kquant_encode.fit_signed_scale, compiled."""
    scale, q = np.empty(x.shape[0], _F32), np.empty(x.shape, _F32)
    _fit_signed_scale(np.ascontiguousarray(x, _F32), _F32(nmax), scale, q, np.empty_like(q))
    return scale, q


SEARCHES = Searches(fit_scale_min, fit_q3_scale, fit_signed_scale)
