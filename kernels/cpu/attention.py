"""Fused attention elementwise passes for float32 on the CPU (scores come from BLAS).

softmax_rows: s <- softmax(s * scale) per row, in place, and the row's log-sum-exp
probs_t:      p <- exp(p * scale - lse) on transposed scores (keys x queries), in place
dscores_t:    d <- (d - delta) * p * scale on transposed scores, in place
Masked scores are -inf beforehand and come out as exact zeros. The causal mask of a block of
grouped query rows can instead be applied here (`causal` = (rows, r0, groups, shift)): row i
of a slice of `rows` rows is grouped query row r0 + i, at position (r0 + i) // groups + shift,
and sees the keys up to that position; the rest come out as exact zeros. That spares building
the mask and a pass over the scores per block. groups = 0: no causal limit.
"""
import math

import numpy as np
from numba import prange

from . import SERIAL_MAX, kernel
from .fastexp import BODY_FASTMATH, SAFE_FASTMATH, fexp
from .row_reduce import row_max, row_sum

NO_CAUSAL = (1, 0, 0, 0)  # (rows, r0, groups, shift): every key visible


@kernel(inline="always")
def _visible(i, n, causal):
    """Keys [0, visible) row i of a score slice sees (all n without a causal limit)."""
    rows, r0, groups, shift = causal
    if groups == 0:
        return n
    return max(0, min(n, (r0 + i % rows) // groups + shift + 1))


@kernel(fastmath=BODY_FASTMATH)
def _softmax_row(s, lse, i, scale, causal):
    n = _visible(i, s.shape[1], causal)
    for j in range(n, s.shape[1]):
        s[i, j] = 0.0
    if n == 0:  # a row that sees no key (not one of attention's): no probability anywhere
        lse[i] = -math.inf
        return
    m = row_max(s, i, n, scale)
    for j in range(n):  # the exps, then their sum: BODY_FASTMATH (fastexp.py) says why
        s[i, j] = fexp(s[i, j] * scale - m)
    acc = row_sum(s, i, n)
    inv = np.float32(1.0) / acc
    for j in range(n):
        s[i, j] *= inv
    lse[i] = m + math.log(acc)


@kernel(parallel=True, fastmath=SAFE_FASTMATH)
def softmax_rows(s, lse, scale, causal):
    """s (R, S) float32; lse (R,) gets max + log(sum(exp(s * scale - max)))."""
    if s.size < SERIAL_MAX:
        for i in range(s.shape[0]):
            _softmax_row(s, lse, i, scale, causal)
    else:
        for i in prange(s.shape[0]):
            _softmax_row(s, lse, i, scale, causal)


@kernel(parallel=True, fastmath=SAFE_FASTMATH)
def probs_t(p, scale, lse, causal):
    """p (BH, S, Q) scores, lse (BH, Q): p <- exp(p * scale - lse[:, None, :]); keys beyond a
    query's causal limit (causal's rows = Q) get 0. One select per value: a loop starting at
    each key's first query ran 3x slower (12 x 256 keys x 192 queries: 0.90 vs 0.29 ms)."""
    bh, keys, q = p.shape
    _, r0, groups, shift = causal
    for t in prange(bh * keys):
        b = t // keys
        k = t % keys
        j0 = 0 if groups == 0 else max(0, min(q, (k - shift) * groups - r0))  # first to see k
        for j in range(q):
            e = fexp(p[b, k, j] * scale - lse[b, j])
            p[b, k, j] = e if j >= j0 else 0.0


@kernel(parallel=True, fastmath=SAFE_FASTMATH)
def dscores_t(d, p, delta, scale):
    """d, p (BH, S, Q), delta (BH, Q): d <- (d - delta[:, None, :]) * p * scale."""
    bh, keys, q = d.shape
    for t in prange(bh * keys):
        b = t // keys
        k = t % keys
        for j in range(q):
            d[b, k, j] = (d[b, k, j] - delta[b, j]) * p[b, k, j] * scale
