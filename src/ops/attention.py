"""Fused causal scaled-dot-product attention with grouped KV heads (one tape node).

Saves q, k, v, the output and the row log-sum-exp; the probabilities are recomputed in backward,
so no (T x T) matrix outlives the op.
"""
import math

from ..autodiff import Function


def _group_q(q, n_kv):
    b, t, h, d = q.shape
    g = h // n_kv
    # (B, T, Hkv, G, D) -> (B, Hkv, G, T, D) -> (B, Hkv, G*T, D)
    return q.reshape(b, t, n_kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, n_kv, g * t, d)


def _ungroup(x, t):
    b, n_kv, gt, d = x.shape
    g = gt // t
    # (B, Hkv, G, T, D) -> (B, T, Hkv, G, D) -> (B, T, H, D)
    return x.reshape(b, n_kv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, n_kv * g, d)


def causal_mask(xp, t, s, groups):
    """(G*T, S) bool: query row r (position r % T + S - T) sees keys at positions <= its own."""
    rows = xp.arange(t)[:, None] + (s - t)
    allowed = xp.arange(s)[None, :] <= rows  # (T, S)
    return xp.tile(allowed, (groups, 1))


class Attention(Function):
    """q: (B, T, H, D); k, v: (B, S, Hkv, D), S >= T (a KV cache makes S > T) -> (B, T, H, D)."""

    def forward(self, q, k, v, scale=None):
        xp = self.xp
        b, t, h, d = q.shape
        s, n_kv = k.shape[1], k.shape[2]
        self.scale = scale if scale is not None else 1.0 / math.sqrt(d)
        qg = _group_q(q, n_kv)  # (B, Hkv, G*T, D)
        kt = k.transpose(0, 2, 3, 1)  # (B, Hkv, D, S)
        vv = v.transpose(0, 2, 1, 3)  # (B, Hkv, S, D)
        scores = qg @ kt  # (B, Hkv, G*T, S)
        scores *= self.scale
        mask = causal_mask(xp, t, s, h // n_kv)
        scores = xp.where(mask, scores, -xp.inf)
        m = scores.max(axis=-1, keepdims=True)
        scores -= m
        xp.exp(scores, out=scores)
        lsum = scores.sum(axis=-1, keepdims=True)
        scores /= lsum
        og = scores @ vv  # (B, Hkv, G*T, D)
        del scores
        lse = m + xp.log(lsum)
        self.t = t
        self.save(qg, kt, vv, og, lse, mask)
        return _ungroup(og, t)

    def backward(self, g):
        xp = self.xp
        qg, kt, vv, og, lse, mask = self.saved
        n_kv = kt.shape[1]
        dog = _group_q(g, n_kv)  # (B, Hkv, G*T, D)
        p = qg @ kt
        p *= self.scale
        p = xp.where(mask, p - lse, -xp.inf)
        xp.exp(p, out=p)
        dq = dk = dv = None
        if self.needs[2]:
            dv = (xp.swapaxes(p, -1, -2) @ dog).transpose(0, 2, 1, 3)  # (B, S, Hkv, D)
        dp = dog @ xp.swapaxes(vv, -1, -2)  # (B, Hkv, G*T, S)
        delta = (dog * og).sum(axis=-1, keepdims=True)
        dp -= delta
        dp *= p
        dp *= self.scale
        del p
        if self.needs[0]:
            dq = _ungroup(dp @ xp.swapaxes(kt, -1, -2), self.t)
        if self.needs[1]:
            dk = (xp.swapaxes(dp, -1, -2) @ qg).transpose(0, 2, 1, 3)  # (B, S, Hkv, D)
        return dq, dk, dv, None
