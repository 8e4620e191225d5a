"""Fused causal scaled-dot-product attention with grouped KV heads (one tape node).

Saves q, k, v, the output and the row log-sum-exp; the probabilities are recomputed in backward,
so no (T x S) matrix outlives the op. Every batched matmul gets operands whose last axis is
contiguous: numpy only hands those to BLAS (a transposed view falls back to a slow loop).
"""
import math

from ..autodiff import Function


def _group_q(q, n_kv):
    b, t, h, d = q.shape
    g = h // n_kv
    # (B, T, Hkv, G, D) -> (B, Hkv, G, T, D) -> (B, Hkv, G*T, D), a contiguous copy
    return q.reshape(b, t, n_kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, n_kv, g * t, d)


def _ungroup(x, t):
    b, n_kv, gt, d = x.shape
    g = gt // t
    # (B, Hkv, G, T, D) -> (B, T, Hkv, G, D) -> (B, T, H, D)
    return x.reshape(b, n_kv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, n_kv * g, d)


def _contig_t(xp, a):
    """The last two axes swapped, as a contiguous array."""
    return xp.ascontiguousarray(xp.swapaxes(a, -1, -2))


def causal_mask(xp, t, s, groups):
    """(G*T, S) bool: query row r (position r % T + S - T) sees keys at positions <= its own."""
    rows = xp.arange(t)[:, None] + (s - t)
    allowed = xp.arange(s)[None, :] <= rows  # (T, S)
    return xp.tile(allowed, (groups, 1))


def blocked_mask(xp, t, s, groups, key_valid=None):
    """True where a score is masked: (G*T, S), or (B, 1, G*T, S) with key_valid (B, S) marking
    real (not padding) keys. A padding query still sees itself, so no row is empty."""
    allowed = causal_mask(xp, t, s, groups)
    if key_valid is None:
        return ~allowed
    rows = xp.arange(t)[:, None] + (s - t)
    own = xp.tile(xp.arange(s)[None, :] == rows, (groups, 1))  # (G*T, S)
    return ~(allowed & (key_valid[:, None, None, :] | own))


SCORE_BYTES = 8 << 20  # the backward's score matrices of one batch slice stay under this


class Attention(Function):
    """q: (B, T, H, D); k, v: (B, S, Hkv, D), S >= T (a KV cache makes S > T) -> (B, T, H, D)."""

    def forward(self, q, k, v, scale=None, key_valid=None):
        xp = self.xp
        b, t, h, d = q.shape
        s, n_kv = k.shape[1], k.shape[2]
        self.scale = scale if scale is not None else 1.0 / math.sqrt(d)
        qg = _group_q(q, n_kv)  # (B, Hkv, G*T, D)
        kc = xp.ascontiguousarray(k.transpose(0, 2, 1, 3))  # (B, Hkv, S, D)
        vv = xp.ascontiguousarray(v.transpose(0, 2, 1, 3))  # (B, Hkv, S, D)
        scores = qg @ _contig_t(xp, kc)  # (B, Hkv, G*T, S)
        scores *= self.scale
        blocked = blocked_mask(xp, t, s, h // n_kv, key_valid)
        xp.copyto(scores, -xp.inf, where=blocked)
        m = scores.max(axis=-1, keepdims=True)
        scores -= m
        xp.exp(scores, out=scores)
        lsum = scores.sum(axis=-1, keepdims=True)
        scores /= lsum
        og = scores @ vv  # (B, Hkv, G*T, D)
        del scores
        lse = m + xp.log(lsum)  # (B, Hkv, G*T, 1)
        self.t = t
        self.save(qg, kc, vv, og, lse, blocked)
        return _ungroup(og, t)

    def backward(self, g):
        # batch rows in slices, so the two (S x G*T) score matrices stay a bounded transient
        xp = self.xp
        qg, kc, vv, og, lse, blocked = self.saved
        b, n_kv, gt, d = qg.shape
        dog = _group_q(g, n_kv)  # (B, Hkv, G*T, D)
        per_row = 2 * n_kv * gt * kc.shape[2] * qg.itemsize
        step = max(1, min(b, SCORE_BYTES // max(per_row, 1)))
        dqg, dkc, dvv = xp.empty_like(qg), xp.empty_like(kc), xp.empty_like(vv)
        for b0 in range(0, b, step):
            sl = slice(b0, b0 + step)
            mask = blocked[sl] if blocked.ndim == 4 else blocked
            self._backward_rows(qg[sl], kc[sl], vv[sl], og[sl], lse[sl], mask, dog[sl],
                                dqg[sl], dkc[sl], dvv[sl])
        dq = _ungroup(dqg, self.t) if self.needs[0] else None
        dk = dkc.transpose(0, 2, 1, 3) if self.needs[1] else None  # (B, S, Hkv, D)
        dv = dvv.transpose(0, 2, 1, 3) if self.needs[2] else None
        return dq, dk, dv, None, None

    def _backward_rows(self, qg, kc, vv, og, lse, blocked, dog, dqg, dkc, dvv):
        """Gradients of one slice of batch rows; works on transposed scores (S x G*T) so every
        big matmul operand is contiguous."""
        xp = self.xp
        pt = kc @ _contig_t(xp, qg)  # (b, Hkv, S, G*T)
        pt *= self.scale
        pt -= _contig_t(xp, lse)
        xp.copyto(pt, -xp.inf, where=xp.swapaxes(blocked, -1, -2))
        xp.exp(pt, out=pt)
        dvv[...] = pt @ dog  # (b, Hkv, S, D)
        dpt = vv @ _contig_t(xp, dog)  # (b, Hkv, S, G*T)
        delta = (dog * og).sum(axis=-1, keepdims=True)  # (b, Hkv, G*T, 1)
        dpt -= _contig_t(xp, delta)
        dpt *= pt
        dpt *= self.scale
        del pt
        dqg[...] = _contig_t(xp, _contig_t(xp, kc) @ dpt)  # (b, Hkv, G*T, D)
        dkc[...] = dpt @ qg  # (b, Hkv, S, D)
