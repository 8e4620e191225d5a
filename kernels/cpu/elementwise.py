"""Fused elementwise kernels for the CPU: RMSNorm, SwiGLU and RoPE, forward and backward.

Each replaces several numpy passes (and their temporaries) with one parallel loop over rows.
Arrays are C-contiguous; rows are the flattened leading axes. Inputs under SERIAL_MAX elements
(a decode step's single token) stay on the calling thread.
"""
import math

import numpy as np
from numba import prange

from . import SERIAL_MAX, kernel
from .fastexp import BODY_FASTMATH, SAFE_FASTMATH, fexp, one_like


@kernel(fastmath=True)
def _rmsnorm_row(x, w, eps, y, r, i):
    d = x.shape[1]
    acc = 0.0
    for j in range(d):
        acc += x[i, j] * x[i, j]
    inv = 1.0 / math.sqrt(acc / d + eps)
    r[i] = inv
    for j in range(d):
        y[i, j] = x[i, j] * inv * w[j]


@kernel(parallel=True, fastmath=True)
def rmsnorm_fwd(x, w, eps, y, r):
    """x, y: (R, D); w: (D,); r: (R,) gets 1/sqrt(mean(x^2) + eps)."""
    if x.size < SERIAL_MAX:
        for i in range(x.shape[0]):
            _rmsnorm_row(x, w, eps, y, r, i)
    else:
        for i in prange(x.shape[0]):
            _rmsnorm_row(x, w, eps, y, r, i)


@kernel(parallel=True, fastmath=True)
def rmsnorm_bwd(g, x, w, r, dx):
    """dx = r * (g*w - xhat * mean(g*w*xhat)), xhat = x * r; all (R, D) except w (D,), r (R,)."""
    rows, d = x.shape
    for i in prange(rows):
        inv = r[i]
        dot = 0.0
        for j in range(d):
            dot += g[i, j] * w[j] * x[i, j] * inv
        dot /= d
        for j in range(d):
            xhat = x[i, j] * inv
            dx[i, j] = inv * (g[i, j] * w[j] - xhat * dot)


@kernel(fastmath=SAFE_FASTMATH)
def _swiglu_row(gate, up, y, i):
    for j in range(gate.shape[1]):
        a = gate[i, j]
        y[i, j] = a / (one_like(a) + fexp(-a)) * up[i, j]


@kernel(parallel=True, fastmath=SAFE_FASTMATH)
def swiglu_fwd(gate, up, y):
    """y = silu(gate) * up over (R, D)."""
    if gate.size < SERIAL_MAX:
        for i in range(gate.shape[0]):
            _swiglu_row(gate, up, y, i)
    else:
        for i in prange(gate.shape[0]):
            _swiglu_row(gate, up, y, i)


@kernel(parallel=True, fastmath=BODY_FASTMATH)
def swiglu_bwd(g, gate, up, dgate, dup, want_gate, want_up):
    rows, d = gate.shape
    for i in prange(rows):
        for j in range(d):
            a = gate[i, j]
            one = one_like(a)
            s = one / (one + fexp(-a))
            if want_gate:
                dgate[i, j] = g[i, j] * up[i, j] * s * (one + a * (one - s))
            if want_up:
                dup[i, j] = g[i, j] * a * s


@kernel(fastmath=True)
def _rope_position(x, cos, sin, out, sign, bt):
    t, h, d = x.shape[1:]
    half = d // 2
    bi = bt // t
    ti = bt % t
    row = bt % cos.shape[0]  # tables of (T, D/2) shared by the rows, or (B*T, D/2) per row
    for hi in range(h):
        for j in range(half):
            c = cos[row, j]
            s = sin[row, j] * sign
            x1 = x[bi, ti, hi, j]
            x2 = x[bi, ti, hi, j + half]
            out[bi, ti, hi, j] = x1 * c - x2 * s
            out[bi, ti, hi, j + half] = x2 * c + x1 * s


@kernel(parallel=True, fastmath=True)
def rope_apply(x, cos, sin, out, sign):
    """Rotate-half RoPE over x (B, T, H, D) with cos/sin (T, D/2), or (B*T, D/2) when each row
    has positions of its own (packed rows); sign=-1 applies the inverse rotation (backward)."""
    positions = x.shape[0] * x.shape[1]
    if x.size < SERIAL_MAX:
        for bt in range(positions):
            _rope_position(x, cos, sin, out, sign, bt)
    else:
        for bt in prange(positions):
            _rope_position(x, cos, sin, out, sign, bt)


def rows2(a):
    """A C-contiguous (R, D) view (or copy) of an array (..., D)."""
    return np.ascontiguousarray(a).reshape(-1, a.shape[-1])
