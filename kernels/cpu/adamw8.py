"""8-bit AdamW's update in one pass over each 256-value block, for the CPU.

The moments are stored as training/states.py keeps them: one byte per value indexing a sorted
256-entry dynamic map, times the block's largest magnitude. Per block this kernel decodes both
moments, applies the AdamW arithmetic, re-encodes them with the block's new largest magnitude and
updates the weights: the numpy path's arithmetic, value for value, without its ~30 passes and
temporaries over every tensor (the numpy path stays for other array modules).

Every scalar arrives as float32 and no fastmath is allowed: each product and sum is rounded to
float32 in the same order as the numpy expressions, so both paths give the same bits.
"""
import math

import numpy as np
from numba import prange

from . import kernel

BLOCK = 256
# The update's float32 scalars, in adamw8_update's argument order.
HYPER = ("decay", "b1", "one_b1", "b2", "one_b2", "c2", "eps", "step_size")


@kernel()
def _code_index(y, code):
    """The map index of y as quant.blockwise.dynamic_quantize picks it (binary search from 127,
    then the float32 midpoint against the neighbour on y's side; NaN lands on 0)."""
    pivot, lower, upper = 127, 0, 255
    for k in range(6, -1, -1):  # selects, not branches: the comparisons are as good as random
        step = 1 << k
        up = y > code[pivot]
        lower = pivot if up else lower
        upper = upper if up else pivot
        pivot = pivot + step if up else pivot - step
    val = code[pivot]
    half = np.float32(0.5)
    above = upper if y > (code[upper] + val) * half else pivot
    below = lower if y < (code[lower] + val) * half else pivot
    return above if y > val else below


@kernel()
def _encode(x, n, codes, absmax, b, code):
    """codes[b*256:...] and absmax[b] of the n values x[:n] (one block)."""
    mx = np.float32(0.0)
    for i in range(n):
        a = abs(x[i])
        if a > mx or a != a:  # a NaN propagates, as numpy's max does
            mx = a
    absmax[b] = mx
    safe = mx if mx > 0 else np.float32(1.0)
    base = b * BLOCK
    for i in range(n):
        codes[base + i] = _code_index(x[i] / safe, code)


@kernel(parallel=True)
def adamw8_update(w, g, m_codes, m_absmax, v_codes, v_absmax, code_s, code_u,
                  decay, b1, one_b1, b2, one_b2, c2, eps, step_size):
    """One AdamW step of the flat float32 weights w (N,) from their grad g (N,), both moments
    8-bit. decay: the weight-decay factor (1 - lr*wd), or 1 for none; one_b1 = 1 - b1, and so
    on; c2 = 1 - b2^t; step_size = lr / (1 - b1^t)."""
    n = w.size
    for b in prange((n + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        cnt = min(BLOCK, n - lo)
        m = np.empty(BLOCK, np.float32)
        v = np.empty(BLOCK, np.float32)
        ma, va = m_absmax[b], v_absmax[b]
        for i in range(cnt):
            gi = g[lo + i]
            m[i] = code_s[m_codes[lo + i]] * ma * b1 + one_b1 * gi
            v[i] = code_u[v_codes[lo + i]] * va * b2 + one_b2 * (gi * gi)
        _encode(m, cnt, m_codes, m_absmax, b, code_s)
        _encode(v, cnt, v_codes, v_absmax, b, code_u)
        for i in range(cnt):
            wi = w[lo + i]
            if decay != 1:
                wi = wi * decay
            denom = np.float32(math.sqrt(v[i] / c2)) + eps
            w[lo + i] = wi - step_size * (m[i] / denom)
