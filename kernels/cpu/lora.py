"""Thin LoRA products fused on the CPU: BLAS is slow at rank-16 inner or outer dimensions.

add_lora_out:  y += s * xa @ B.T            one pass over y, no (M, N) temporary
lora_grads:    gxa = s * g @ B and dB = s * g.T @ xa in ONE pass over g (M, N)
"""
import numpy as np
from numba import get_num_threads, njit, prange


@njit(parallel=True, fastmath=True, cache=True)
def _add_lora_out(y, xa, bt, s):
    m_rows, n = y.shape
    r = xa.shape[1]
    for m in prange(m_rows):
        for k in range(r):
            coef = s * xa[m, k]
            for j in range(n):
                y[m, j] += coef * bt[k, j]


def add_lora_out(y, xa, b, s):
    """y (M, N) += s * xa (M, r) @ b (N, r).T, vectorised along N."""
    _add_lora_out(y, xa, np.ascontiguousarray(b.T), np.float32(s))


@njit(parallel=True, fastmath=True, cache=True)
def _lora_grads(g, b, xa, s, gxa, parts, nchunks):
    m_rows, n = g.shape
    r = b.shape[1]
    step = (m_rows + nchunks - 1) // nchunks
    for c in prange(nchunks):
        part = parts[c]
        acc = np.zeros(r, dtype=np.float32)
        for m in range(c * step, min(m_rows, (c + 1) * step)):
            acc[:] = 0.0
            for j in range(n):
                gv = g[m, j]
                for k in range(r):
                    acc[k] += gv * b[j, k]
                    part[j, k] += gv * xa[m, k]
            for k in range(r):
                gxa[m, k] = s * acc[k]


def lora_grads(g, b, xa, s):
    """(gxa (M, r) = s * g @ b, db (N, r) = s * g.T @ xa), reading g (M, N) once."""
    m_rows, n = g.shape
    r = b.shape[1]
    nchunks = max(1, min(get_num_threads(), m_rows))
    parts = np.zeros((nchunks, n, r), dtype=np.float32)
    gxa = np.empty((m_rows, r), dtype=np.float32)
    _lora_grads(g, b, xa, np.float32(s), gxa, parts, nchunks)
    db = parts.sum(axis=0) if nchunks > 1 else parts[0]
    db *= np.float32(s)
    return gxa, db
