"""Cross-entropy over vocabulary rows, fused: one parallel pass per row instead of six numpy ones.

ce_rows:      lse[i] = logsumexp(z[i]); nll[i] = lse[i] - z[i, t[i]] (0 where t[i] is ignored)
ce_grad_rows: z[i] <- (softmax(z[i]) - onehot(t[i])) * w[i], in place, from the saved lse
"""
import math

from numba import njit, prange

from .fastexp import SAFE_FASTMATH, fexp


@njit(parallel=True, fastmath=SAFE_FASTMATH, cache=True)
def ce_rows(z, targets, ignore_index, lse, nll):
    rows, v = z.shape
    for i in prange(rows):
        m = z[i, 0]
        for j in range(1, v):
            if z[i, j] > m:
                m = z[i, j]
        acc = 0.0
        for j in range(v):
            acc += fexp(z[i, j] - m)
        lse[i] = m + math.log(acc)
        t = targets[i]
        nll[i] = 0.0 if t == ignore_index else lse[i] - z[i, t]


@njit(parallel=True, fastmath=SAFE_FASTMATH, cache=True)
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
