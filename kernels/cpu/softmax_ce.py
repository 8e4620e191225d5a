"""Cross-entropy over vocabulary rows, fused: one parallel pass per row instead of six numpy ones.

ce_rows:      lse[i] = logsumexp(z[i]); nll[i] = lse[i] - z[i, t[i]] (0 where t[i] is ignored)
ce_grad_rows: z[i] <- (softmax(z[i]) - onehot(t[i])) * w[i], in place, from the saved lse
"""
import math

import numpy as np
from numba import prange

from . import kernel
from .fastexp import BODY_FASTMATH, fexp
from .row_reduce import row_exp_sum, row_max


@kernel(parallel=True, fastmath=BODY_FASTMATH)
def ce_rows(z, targets, ignore_index, lse, nll):
    rows, v = z.shape
    for i in prange(rows):
        m = row_max(z, i, v, np.float32(1.0))
        lse[i] = m + math.log(row_exp_sum(z, i, v, m))
        t = targets[i]
        nll[i] = 0.0 if t == ignore_index else lse[i] - z[i, t]


@kernel(parallel=True, fastmath=BODY_FASTMATH)
def ce_grad_rows(z, targets, ignore_index, lse, w):
    rows, v = z.shape
    for i in prange(rows):
        t = targets[i]
        if t == ignore_index:
            for j in range(v):
                z[i, j] = 0.0
            continue
        wi = w
        li = lse[i]
        for j in range(v):
            z[i, j] = fexp(z[i, j] - li) * wi
        z[i, t] -= wi
