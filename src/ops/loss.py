"""Fused cross-entropy over row chunks: the full probability matrix is never materialised."""

from ..autodiff import Function


def chunk_lse(xp, logits, chunk):
    """Row-wise log-sum-exp of (N, V) logits, computed chunk by chunk in float32/64."""
    n = logits.shape[0]
    lse = xp.empty(n, dtype=logits.dtype)
    for i in range(0, n, chunk):
        z = logits[i:i + chunk]
        m = z.max(axis=1, keepdims=True)
        lse[i:i + chunk] = (m + xp.log(xp.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    return lse


class CrossEntropy(Function):
    """Mean negative log-likelihood of `targets` under `logits` (..., V), skipping ignore_index."""

    def forward(self, logits, targets, ignore_index=-100, chunk=256):
        xp = self.xp
        v = logits.shape[-1]
        flat = logits.reshape(-1, v)
        tgt = targets.reshape(-1)
        valid = tgt != ignore_index
        count = int(valid.sum())
        safe = xp.where(valid, tgt, 0)
        lse = chunk_lse(xp, flat, chunk)
        picked = flat[xp.arange(flat.shape[0]), safe]
        loss = ((lse - picked) * valid).sum() / max(count, 1)
        self.chunk, self.count, self.shape = chunk, count, logits.shape
        self.save(flat if self.needs[0] else None, lse, safe, valid)
        return xp.asarray(loss, dtype=logits.dtype)

    def backward(self, g):
        flat, lse, safe, valid = self.saved
        xp = self.xp
        n = flat.shape[0]
        out = xp.empty_like(flat)
        scale = (g / max(self.count, 1)).astype(flat.dtype)
        for i in range(0, n, self.chunk):
            sl = slice(i, i + self.chunk)
            p = xp.exp(flat[sl] - lse[sl, None])
            p[xp.arange(p.shape[0]), safe[sl]] -= 1.0
            p *= (valid[sl, None] * scale).astype(p.dtype)
            out[sl] = p
        return out.reshape(self.shape), None

