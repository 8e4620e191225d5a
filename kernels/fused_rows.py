"""Fused row kernels on whole arrays: the Numba CPU kernel for float32 numpy arrays, the same
math as array expressions on any other array module (cupy on a GPU, float64 in gradient checks).

The ops call these; none of them asks which backend it runs on."""
import numpy as np

from .cpu import attention as cpu_attention
from .cpu import decode_attention as cpu_decode_attention
from .cpu import elementwise as cpu_ew
from .cpu import softmax_ce as cpu_ce
from .cpu import takes


def _sigmoid(xp, x):
    return 1.0 / (1.0 + xp.exp(-x))


# -- RMSNorm ----------------------------------------------------------------------------------
def rmsnorm_fwd(xp, x, weight, eps):
    """(y, x2, r): y = x * r * weight with r = 1/sqrt(mean(x^2) + eps) per row; x2 is x as rows
    (N, D) and r (N,), what the backward needs."""
    d = x.shape[-1]
    if takes(xp, x):
        x2 = cpu_ew.rows2(x)
        y = np.empty_like(x2)
        r = np.empty(x2.shape[0], dtype=x.dtype)
        cpu_ew.rmsnorm_fwd(x2, weight.astype(x.dtype, copy=False), eps, y, r)
        return y.reshape(x.shape), x2, r
    x2 = x.reshape(-1, d)
    r = (1.0 / xp.sqrt((x2 * x2).mean(axis=-1) + eps)).astype(x.dtype, copy=False)
    return (x2 * r[:, None] * weight).reshape(x.shape), x2, r


def rmsnorm_bwd(xp, g2, x2, weight, r):
    """dx (N, D) of RMSNorm for the row gradient g2 (N, D)."""
    if takes(xp, g2, x2):
        dx = np.empty_like(x2)
        cpu_ew.rmsnorm_bwd(g2, x2, weight.astype(x2.dtype, copy=False), r, dx)
        return dx
    r2 = r[:, None]
    xhat = x2 * r2
    gw = g2 * weight
    return r2 * (gw - xhat * (gw * xhat).mean(axis=-1, keepdims=True))


# -- SwiGLU -----------------------------------------------------------------------------------
def swiglu_fwd(xp, gate, up):
    """silu(gate) * up."""
    if takes(xp, gate, up) and gate.shape == up.shape:
        y = np.empty(gate.shape, dtype=gate.dtype)
        cpu_ew.swiglu_fwd(cpu_ew.rows2(gate), cpu_ew.rows2(up), y.reshape(-1, gate.shape[-1]))
        return y
    return gate * _sigmoid(xp, gate) * up


def swiglu_bwd(xp, g, gate, up, want_gate, want_up):
    """(dgate or None, dup or None) of silu(gate) * up."""
    if takes(xp, g, gate, up) and gate.shape == up.shape == g.shape:
        d = gate.shape[-1]
        dgate, dup = np.empty_like(gate), np.empty_like(up)
        cpu_ew.swiglu_bwd(cpu_ew.rows2(g), cpu_ew.rows2(gate), cpu_ew.rows2(up),
                          dgate.reshape(-1, d), dup.reshape(-1, d), want_gate, want_up)
        return (dgate if want_gate else None), (dup if want_up else None)
    s = _sigmoid(xp, gate)
    dgate = g * up * (s * (1 + gate * (1 - s))) if want_gate else None
    dup = g * (gate * s) if want_up else None
    return dgate, dup


# -- RoPE -------------------------------------------------------------------------------------
def rope_rotate(xp, x, c, s, sign):
    """x (B, T, H, D) with the pairs (i, i + D/2) rotated by the angles of c, s: (T, D/2) for
    every row, or (B, T, D/2) per row (packed rows restart their positions); sign -1 rotates
    back (the backward)."""
    if takes(xp, x, c, s):
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        half = c.shape[-1]
        cpu_ew.rope_apply(x, c.reshape(-1, half), s.reshape(-1, half), out, sign)
        return out
    half = x.shape[-1] // 2
    if c.ndim == 2:
        c, s = c[None], s[None]
    cb, sb = c[:, :, None, :], sign * s[:, :, None, :]  # (1 or B, T, 1, D/2)
    x1, x2 = x[..., :half], x[..., half:]
    out = xp.empty_like(x)
    out[..., :half] = x1 * cb - x2 * sb
    out[..., half:] = x2 * cb + x1 * sb
    return out


# -- attention score blocks -------------------------------------------------------------------
def query_positions(xp, causal):
    """(rows,) positions of a block's grouped query rows: the last key each may see (see
    cpu/attention.py for `causal`)."""
    rows, r0, groups, shift = causal
    return (r0 + xp.arange(rows)) // groups + shift


def _causal_hidden(xp, keys, causal):
    """True where a (rows, keys) block of scores lies beyond its rows' causal limits."""
    return xp.arange(keys)[None, :] > query_positions(xp, causal)[:, None]


def softmax_(xp, sc, scale=1.0, causal=None):
    """sc (..., rows, S) <- softmax(sc * scale) in place, keys beyond the rows' causal limits
    (`causal`, cpu/attention.py; None: none) zero; returns the log-sum-exp (..., rows, 1)."""
    if takes(xp, sc):
        lse = np.empty(sc.shape[:-1] + (1,), dtype=sc.dtype)
        cpu_attention.softmax_rows(sc.reshape(-1, sc.shape[-1]), lse.reshape(-1),
                                   np.float32(scale), causal or cpu_attention.NO_CAUSAL)
        return lse
    sc *= scale
    if causal is not None:
        xp.copyto(sc, -xp.inf, where=_causal_hidden(xp, sc.shape[-1], causal))
    m = sc.max(axis=-1, keepdims=True)
    sc -= m
    xp.exp(sc, out=sc)
    lsum = sc.sum(axis=-1, keepdims=True)
    sc /= lsum
    return m + xp.log(lsum)


_ALL_VALID = np.ones((1, 1), np.bool_)  # one_query's mask slot where no key is masked


def one_query_attention(xp, q, k, v, key_valid, scale):
    """out (B, H, D) of one query position q (B, H, D) over keys and values (B, S, Hkv, D)
    (views of a KV cache), keys where key_valid (B, S) is False left out; None where no
    kernel takes these arrays (the caller keeps its array expressions)."""
    if not takes(xp, q, k, v) or k.strides[-1] != 4 or v.strides[-1] != 4:
        return None
    out = np.empty(q.shape, np.float32)
    masked = key_valid is not None
    valid = key_valid if masked else _ALL_VALID
    cpu_decode_attention.one_query(q, k, v, valid, masked, np.float32(scale), out)
    return out


def probs_t_(xp, pt, scale, lse_t, causal=None):
    """pt (b, Hkv, S, Q) <- exp(pt * scale - lse_t) in place; lse_t (b, Hkv, 1, Q); keys beyond
    the queries' causal limits (`causal` with rows = Q; None: none) zero."""
    if takes(xp, pt, lse_t):
        n = pt.shape[0] * pt.shape[1]
        cpu_attention.probs_t(pt.reshape(n, *pt.shape[2:]), np.float32(scale),
                              np.ascontiguousarray(lse_t).reshape(n, -1),
                              causal or cpu_attention.NO_CAUSAL)
        return
    pt *= scale
    pt -= lse_t
    xp.exp(pt, out=pt)
    if causal is not None:
        pt[xp.broadcast_to(_causal_hidden(xp, pt.shape[-2], causal).T, pt.shape)] = 0.0


def dscores_t_(xp, dpt, pt, delta_t, scale):
    """dpt <- (dpt - delta_t) * pt * scale in place (transposed scores, delta_t (b, Hkv, 1, Q))."""
    if takes(xp, dpt, pt, delta_t):
        n = dpt.shape[0] * dpt.shape[1]
        cpu_attention.dscores_t(dpt.reshape(n, *dpt.shape[2:]), pt.reshape(n, *pt.shape[2:]),
                                np.ascontiguousarray(delta_t).reshape(n, -1), np.float32(scale))
        return
    dpt -= delta_t
    dpt *= pt
    dpt *= scale


# -- cross-entropy of a logits chunk ----------------------------------------------------------
# Bytes of exp(z - max) the array-expression forward (the GPU's) holds at once: a whole chunk's
# would be two (c, V) temporaries, which no memory plan counts (48 MiB each at SmolLM2's vocab).
CE_TEMP_BYTES = 8 << 20


def ce_forward(xp, z, t, ignore):
    """(lse (c,), summed nll) of a logits chunk z (c, V) and its targets t (c,)."""
    if takes(xp, z):
        lse = np.empty(z.shape[0], np.float32)
        nll = np.empty(z.shape[0], np.float32)
        cpu_ce.ce_rows(z, t.astype(np.int64, copy=False), ignore, lse, nll)
        return lse, float(nll.sum(dtype=np.float64))
    m = z.max(axis=1)                                               # (c,)
    lse = xp.empty_like(m)
    rows = max(1, CE_TEMP_BYTES // (z.itemsize * z.shape[1]))
    for r0 in range(0, z.shape[0], rows):  # exp(z - max), `rows` rows at a time: (rows, V)
        e = z[r0:r0 + rows] - m[r0:r0 + rows, None]
        xp.exp(e, out=e)
        lse[r0:r0 + rows] = xp.log(e.sum(axis=1))
    lse += m
    ok = t != ignore
    picked = z[xp.arange(z.shape[0]), xp.where(ok, t, 0)]
    return lse, float(((lse - picked) * ok).sum())


def ce_backward_(xp, z, t, ignore, lse, scale):
    """z <- (softmax(z) - onehot(t)) * scale in place (0 on ignored rows); returns z."""
    if takes(xp, z):
        cpu_ce.ce_grad_rows(z, t.astype(np.int64, copy=False), ignore, lse, np.float32(scale))
        return z
    z -= lse[:, None]
    xp.exp(z, out=z)
    ok = t != ignore
    z[xp.arange(z.shape[0]), xp.where(ok, t, 0)] -= 1.0
    z *= (ok * scale).astype(z.dtype)[:, None]
    return z
