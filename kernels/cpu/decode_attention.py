"""Attention of one new position over a KV cache, fused, for float32 on the CPU (decoding).

out[b, h] = softmax(q[b, h] . k[b, :, h // G] * scale) @ v[b, :, h // G], G = H / Hkv query
heads per key/value head (grouped-query attention), keys where `valid` is False (left padding)
left out. k and v are the cache's own (B, S, Hkv, D) views, read in place. A task per (row,
key/value head) computes the scores of its G query heads (each key read once for all G), their
softmax (max first, the exps, then their sum, as the softmax row kernel) and the weighted sums
of values (each value row read once): a one-token step's attention had been a dozen numpy
calls (batched matmuls, reshapes, the softmax kernel) per layer. A NaN score makes its head's
output NaN.
"""
import numpy as np
from numba import prange

from . import SERIAL_MAX, kernel
from .fastexp import BODY_FASTMATH, SAFE_FASTMATH, fexp
from .row_reduce import row_sum


@kernel(fastmath=SAFE_FASTMATH)
def _dot(q, k, b, h, s, kv):
    """q[b, h] . k[b, s, kv] (reassoc lets LLVM vectorize it; BODY_FASTMATH in fastexp.py)."""
    acc = np.float32(0.0)
    for j in range(q.shape[2]):
        acc += q[b, h, j] * k[b, s, kv, j]
    return acc


@kernel(fastmath=BODY_FASTMATH)
def _scores(q, k, valid, masked, scale, b, kv, g, sc):
    """sc (G, S) <- the scores of query heads kv * G .. kv * G + G - 1 (each key read once for
    the G heads); returns each head's largest score (G,)."""
    m = np.full(g, -np.inf, np.float32)
    for s in range(k.shape[1]):
        if masked and not valid[b, s]:
            for i in range(g):
                sc[i, s] = -np.inf
            continue
        for i in range(g):
            sc[i, s] = _dot(q, k, b, kv * g + i, s, kv) * scale
            m[i] = max(m[i], sc[i, s])
    return m


@kernel(fastmath=BODY_FASTMATH)
def _group(q, k, v, valid, masked, scale, out, t, sc, acc):
    """Task t = b * Hkv + kv: its G query heads into out[b, kv * G: (kv + 1) * G]; sc (G, S)
    and acc (G, D) float32 scratch."""
    nkv = k.shape[2]
    b, kv = t // nkv, t % nkv
    g = q.shape[1] // nkv
    m = _scores(q, k, valid, masked, scale, b, kv, g, sc)
    for i in range(g):
        for s in range(k.shape[1]):  # the exps, then their sum (BODY_FASTMATH)
            sc[i, s] = fexp(sc[i, s] - m[i])
        inv = np.float32(1.0) / row_sum(sc, i, k.shape[1])
        for s in range(k.shape[1]):
            sc[i, s] *= inv
    acc[:] = 0.0
    for s in range(k.shape[1]):
        for i in range(g):
            p = sc[i, s]
            for j in range(acc.shape[1]):
                acc[i, j] += p * v[b, s, kv, j]
    for i in range(g):
        for j in range(acc.shape[1]):
            out[b, kv * g + i, j] = acc[i, j]


@kernel(parallel=True, fastmath=SAFE_FASTMATH)
def one_query(q, k, v, valid, masked, scale, out):
    """q (B, H, D), k and v (B, S, Hkv, D), valid (B, S) bool (read where `masked`), out
    (B, H, D). A task per (row, key/value head); serial below SERIAL_MAX values of keys and
    values."""
    tasks = k.shape[0] * k.shape[2]
    g = q.shape[1] // k.shape[2]
    if 2 * k.size < SERIAL_MAX:
        sc = np.empty((g, k.shape[1]), np.float32)
        acc = np.empty((g, q.shape[2]), np.float32)
        for t in range(tasks):
            _group(q, k, v, valid, masked, scale, out, t, sc, acc)
    else:
        for t in prange(tasks):
            _group(q, k, v, valid, masked, scale, out, t, np.empty((g, k.shape[1]), np.float32),
                   np.empty((g, q.shape[2]), np.float32))
