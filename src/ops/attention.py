"""Fused causal scaled-dot-product attention with grouped KV heads (one tape node).

Saves q, k, v, the output and the row log-sum-exp; the probabilities are recomputed in backward
and the mask applies per block (the causal part inside the softmax kernels, padding and packed
segments as -inf written into the block), so nothing of size T x S exists beyond one block of
scores: the op's memory grows linearly in T (flash attention's blocking). Queries go in blocks
of QUERY_CHUNK positions and each block only meets the keys it can see (a prefix), which skips
most of the causally masked half of the scores. Every batched matmul gets operands whose last
axis is contiguous: numpy only hands those to BLAS (a transposed view falls back to a slow
loop).
"""
import math

from .. import kernels
from ..autodiff import Function

QUERY_CHUNK = 64  # query positions per score block
SCORE_BYTES = 8 << 20  # the backward's score blocks of one batch slice stay under this


def _group_q(q, n_kv):
    b, t, h, d = q.shape
    g = h // n_kv
    # (B, T, Hkv, G, D) -> (B, Hkv, T, G, D) -> (B, Hkv, T*G, D): row r is position r // G
    return q.reshape(b, t, n_kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, n_kv, t * g, d)


def _ungroup(x, t):
    b, n_kv, tg, d = x.shape
    g = tg // t
    # (B, Hkv, T, G, D) -> (B, T, Hkv, G, D) -> (B, T, H, D)
    return x.reshape(b, n_kv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, n_kv * g, d)


def _contig_t(xp, a):
    """The last two axes swapped, as a contiguous array."""
    return xp.ascontiguousarray(xp.swapaxes(a, -1, -2))


def query_blocks(t, s, groups):
    """(row0, row1, keys) per block of query positions: its rows of the grouped q and the
    length of the key prefix it sees (a query at position i sees keys <= i + s - t)."""
    out = []
    for t0 in range(0, t, QUERY_CHUNK):
        t1 = min(t, t0 + QUERY_CHUNK)
        out.append((t0 * groups, t1 * groups, t1 + s - t))
    return out


class CausalMask:
    """Which scores a block of query rows may not see, built block by block: the whole
    (T*G, S) grid never exists, so the op's memory grows linearly in T. key_valid (B, S) marks
    real (not padding) keys; segments (B, S) number the examples packed in a row (a query sees
    only keys of its own example). A padding query still sees itself, so no row is empty."""

    def __init__(self, xp, t, s, groups, key_valid=None, segments=None):
        self.xp, self.t, self.s, self.groups = xp, t, s, groups
        self.key_valid, self.segments = key_valid, segments

    @property
    def per_row(self):
        """Whether masks differ between batch rows ((B, 1, rows, e) rather than (rows, e))."""
        return self.key_valid is not None or self.segments is not None

    def rows(self, sl):
        """The mask of batch rows `sl` (a slice)."""
        pick = (lambda a: None if a is None else a[sl])
        return CausalMask(self.xp, self.t, self.s, self.groups, pick(self.key_valid),
                          pick(self.segments))

    def limit(self, r0, r1):
        """The causal limit of grouped query rows [r0, r1), as the row kernels take it
        (kernels/cpu/attention.py's `causal`)."""
        return (r1 - r0, r0, self.groups, self.s - self.t)

    def apply(self, scores, r0, r1, transposed=False):
        """Mask a block of scores of grouped query rows [r0, r1) (B, Hkv, rows, e), or its
        transpose, and return its causal limit for the row kernels, which apply that part;
        padding and packed segments are written here as -inf."""
        if self.per_row:
            blocked = self.block(r0, r1, scores.shape[-2 if transposed else -1])
            self.xp.copyto(scores, -self.xp.inf,
                           where=self.xp.swapaxes(blocked, -1, -2) if transposed else blocked)
        return self.limit(r0, r1)

    def block(self, r0, r1, e):
        """True where padding or packed segments hide a score of grouped query rows [r0, r1)
        and keys [0, e), (B, 1, rows, e) (a per-row mask; the causal part is `limit`'s)."""
        pos = kernels.query_positions(self.xp, self.limit(r0, r1))[:, None]  # (rows, 1)
        hidden = None
        if self.segments is not None:  # block-diagonal
            q_seg = self.segments[:, pos[:, 0]][:, None, :, None]
            hidden = q_seg != self.segments[:, None, None, :e]
        if self.key_valid is not None:  # a padding key is hidden from all but itself
            pad = ~self.key_valid[:, None, None, :e] & (self.xp.arange(e)[None, :] != pos)
            hidden = pad if hidden is None else hidden | pad
        return hidden


class Attention(Function):
    """q: (B, T, H, D); k, v: (B, S, Hkv, D), S >= T (a KV cache makes S > T) -> (B, T, H, D).
    segments (B, S) int, optional: packed rows, attention stays within each example."""

    def forward(self, q, k, v, scale=None, key_valid=None, segments=None):
        xp = self.xp
        b, t, h, d = q.shape
        s, n_kv = k.shape[1], k.shape[2]
        self.scale = scale if scale is not None else 1.0 / math.sqrt(d)
        mask = CausalMask(xp, t, s, h // n_kv, key_valid, segments)
        if t == 1 and not any(self.needs):
            return self._one_query(q, k, v, mask)
        qg = _group_q(q, n_kv)  # (B, Hkv, T*G, D)
        kc = xp.ascontiguousarray(k.transpose(0, 2, 1, 3))  # (B, Hkv, S, D)
        vv = xp.ascontiguousarray(v.transpose(0, 2, 1, 3))  # (B, Hkv, S, D)
        kt = _contig_t(xp, kc)  # (B, Hkv, D, S)
        og = xp.empty_like(qg)
        lse = xp.empty(qg.shape[:3] + (1,), dtype=qg.dtype)  # (B, Hkv, T*G, 1)
        for r0, r1, e in query_blocks(t, s, h // n_kv):
            sc = qg[:, :, r0:r1] @ kt[..., :e]  # (B, Hkv, rows, e)
            lse[:, :, r0:r1] = kernels.softmax_(xp, sc, self.scale, mask.apply(sc, r0, r1))
            og[:, :, r0:r1] = sc @ vv[:, :, :e]
        self.t = t
        self.save(qg, kc, vv, og, lse, mask)
        return _ungroup(og, t)

    def _one_query(self, q, k, v, mask):
        """One new position and no backward (decoding with a KV cache): the keys and values are
        read where they lie, not copied per token, by one fused kernel where it takes the
        arrays (kernels/cpu/decode_attention.py; 2x the numpy path below from 600 cached
        positions on), else by numpy's batched products on views of the cache."""
        if mask.segments is None:  # the fused kernel, where one takes these arrays
            out = kernels.one_query_attention(self.xp, q[:, 0], k, v, mask.key_valid,
                                              self.scale)
            if out is not None:
                return out[:, None]  # (B, 1, H, D)
        qg = _group_q(q, k.shape[2])  # (B, Hkv, G, D)
        sc = qg @ k.transpose(0, 2, 3, 1)  # (B, Hkv, G, S); the cache as a (B, Hkv, D, S) view
        kernels.softmax_(self.xp, sc, self.scale, mask.apply(sc, 0, sc.shape[2]))
        return _ungroup(sc @ v.transpose(0, 2, 1, 3), 1)  # (B, Hkv, G, D) -> (B, 1, H, D)

    def backward(self, g):
        # batch rows in slices, so the transient score blocks stay bounded
        xp = self.xp
        qg, kc, vv, og, lse, mask = self.saved
        b, n_kv, tg, d = qg.shape
        dog = _group_q(g, n_kv)  # (B, Hkv, T*G, D)
        rows = min(tg, QUERY_CHUNK * (tg // self.t))
        per_row = 2 * n_kv * rows * kc.shape[2] * qg.itemsize
        step = max(1, min(b, SCORE_BYTES // max(per_row, 1)))
        dqg, dkc, dvv = xp.empty_like(qg), xp.empty_like(kc), xp.empty_like(vv)
        for b0 in range(0, b, step):
            sl = slice(b0, b0 + step)
            self._backward_rows(qg[sl], kc[sl], vv[sl], og[sl], lse[sl], mask.rows(sl), dog[sl],
                                dqg[sl], dkc[sl], dvv[sl])
        dq = _ungroup(dqg, self.t) if self.needs[0] else None
        dk = dkc.transpose(0, 2, 1, 3) if self.needs[1] else None  # (B, S, Hkv, D)
        dv = dvv.transpose(0, 2, 1, 3) if self.needs[2] else None
        return dq, dk, dv, None, None, None

    def _backward_rows(self, qg, kc, vv, og, lse, mask, dog, dqg, dkc, dvv):
        """Gradients of one slice of batch rows, a query block at a time (the last block sees
        every key, so it writes dk/dv whole and earlier blocks add into a prefix). Scores are
        transposed (keys x rows) so every big matmul operand is contiguous."""
        xp = self.xp
        t, s = self.t, kc.shape[2]
        delta = (dog * og).sum(axis=-1, keepdims=True)  # (b, Hkv, T*G, 1)
        kt = _contig_t(xp, kc)  # (b, Hkv, D, S)
        for i, (r0, r1, e) in enumerate(reversed(query_blocks(t, s, qg.shape[2] // t))):
            qc, dc = qg[:, :, r0:r1], dog[:, :, r0:r1]  # (b, Hkv, rows, D)
            pt = kc[:, :, :e] @ _contig_t(xp, qc)  # (b, Hkv, e, rows)
            causal = mask.apply(pt, r0, r1, transposed=True)
            kernels.probs_t_(xp, pt, self.scale, _contig_t(xp, lse[:, :, r0:r1]), causal)
            dpt = vv[:, :, :e] @ _contig_t(xp, dc)  # (b, Hkv, e, rows)
            kernels.dscores_t_(xp, dpt, pt, _contig_t(xp, delta[:, :, r0:r1]), self.scale)
            dqg[:, :, r0:r1] = _contig_t(xp, kt[..., :e] @ dpt)  # (b, Hkv, rows, D)
            if i == 0:
                dvv[...] = pt @ dc  # (b, Hkv, S, D)
                dkc[...] = dpt @ qc
            else:
                dvv[:, :, :e] += pt @ dc
                dkc[:, :, :e] += dpt @ qc
