"""Fused attention elementwise passes for float32 on the CPU (scores come from BLAS).

softmax_rows: s <- softmax(s) per row, in place, and the row's log-sum-exp
probs_t:      p <- exp(p * scale - lse) on transposed scores (keys x queries), in place
dscores_t:    d <- (d - delta) * p * scale on transposed scores, in place
Masked scores are -inf beforehand and come out as exact zeros.
"""
import math

from numba import njit, prange

from . import SERIAL_MAX
from .fastexp import SAFE_FASTMATH, fexp


@njit(fastmath=SAFE_FASTMATH, cache=True)
def _softmax_row(s, lse, i):
    n = s.shape[1]
    m = s[i, 0]
    for j in range(1, n):
        if s[i, j] > m:  # a NaN is skipped here; the exp pass still makes the row NaN
            m = s[i, j]
    acc = 0.0
    for j in range(n):
        e = fexp(s[i, j] - m)
        s[i, j] = e
        acc += e
    inv = 1.0 / acc
    for j in range(n):
        s[i, j] *= inv
    lse[i] = m + math.log(acc)


@njit(parallel=True, fastmath=SAFE_FASTMATH, cache=True)
def softmax_rows(s, lse):
    """s (R, S) float32; lse (R,) gets max + log(sum(exp(s - max)))."""
    if s.size < SERIAL_MAX:
        for i in range(s.shape[0]):
            _softmax_row(s, lse, i)
    else:
        for i in prange(s.shape[0]):
            _softmax_row(s, lse, i)


@njit(parallel=True, fastmath=SAFE_FASTMATH, cache=True)
def probs_t(p, scale, lse):
    """p (BH, S, Q) scores, lse (BH, Q): p <- exp(p * scale - lse[:, None, :])."""
    bh, keys, q = p.shape
    for t in prange(bh * keys):
        b = t // keys
        k = t % keys
        for j in range(q):
            p[b, k, j] = fexp(p[b, k, j] * scale - lse[b, j])


@njit(parallel=True, fastmath=SAFE_FASTMATH, cache=True)
def dscores_t(d, p, delta, scale):
    """d, p (BH, S, Q), delta (BH, Q): d <- (d - delta[:, None, :]) * p * scale."""
    bh, keys, q = d.shape
    for t in prange(bh * keys):
        b = t // keys
        k = t % keys
        for j in range(q):
            d[b, k, j] = (d[b, k, j] - delta[b, j]) * p[b, k, j] * scale
