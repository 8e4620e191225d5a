"""Quantizing float rows to the K-quants Q4_K, Q5_K and Q6_K in numpy, with the quality of
ggml's reference quantizer (the iterative searches of quantize_row_q*_K_ref in ggml-quants.c),
every sub-block of a tensor at once.

  Q4_K / Q5_K  each 32-value sub-block gets a scale and a min from a weighted least-squares
               search over candidate inverse scales (weights |x| + rms of the sub-block); the
               eight scales and mins are then quantized to 6 bits against the block's largest
               (fp16 d = max/63, dmin likewise) and the codes recomputed with them
  Q6_K         each 16-value sub-block gets a signed scale from a search around -32 / max
               (weights x^2); the sixteen scales become int8 against fp16 d = -max/128
The byte layouts are the decoders' (quant/kquants.py); gguf.quants decodes the result.
"""
import numpy as np

from .ggml import row_quantizer
from .kquants import QK_K

_F32 = np.float32
_EPS = _F32(1e-15)  # a sub-block whose largest |x| is below this is all zeros


def _rint(v):
    """ggml's nearest_int: round half to even, in float32."""
    return np.rint(v)


def _fp16(v):
    """The float32 value an fp16 store keeps, and its two little-endian bytes."""
    h = np.asarray(v, _F32).astype("<f2")
    return h.astype(_F32), h[..., None].view(np.uint8)


def fit_scale_min(x, w, nmax, rmin, rdelta, nstep):
    """x, w (S, n): per row the (scale, min >= 0, codes in [0, nmax]) minimising the weighted
    error of x ~ scale * q - min over nstep + 1 candidate scales (make_qkx2_quants)."""
    top = x.max(axis=1)[:, None]
    lo = np.minimum(x.min(axis=1), 0)[:, None]                          # (S, 1)
    flat = (top == lo)[:, 0]
    span = np.where(flat[:, None], _F32(1), top - lo)
    sum_w = w.sum(axis=1, keepdims=True)
    sum_x = (w * x).sum(axis=1, keepdims=True)
    iscale = _F32(nmax) / span
    scale = 1 / iscale
    q = np.clip(_rint(iscale * (x - lo)), 0, nmax)
    best = (w * (scale * q + lo - x) ** 2).sum(axis=1, keepdims=True)
    mn = lo
    for step in range(nstep + 1):    # each candidate grid starts at the best min so far
        span = top - mn
        iscale = (_F32(rmin + rdelta * step) + _F32(nmax)) / np.where(span > 0, span, _F32(1))
        cand = np.clip(_rint(iscale * (x - mn)), 0, nmax)
        sum_l = (w * cand).sum(axis=1, keepdims=True)
        sum_l2 = (w * cand * cand).sum(axis=1, keepdims=True)
        sum_xl = (w * cand * x).sum(axis=1, keepdims=True)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = np.where(ok, det, _F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        pos = this_min > 0
        this_scale = np.where(pos, sum_xl / np.where(sum_l2 > 0, sum_l2, _F32(1)), this_scale)
        this_min = np.where(pos, _F32(0), this_min)
        err = (w * (this_scale * cand + this_min - x) ** 2).sum(axis=1, keepdims=True)
        take = ok & (err < best) & ~flat[:, None]
        q = np.where(take, cand, q)
        best = np.where(take, err, best)
        scale = np.where(take, this_scale, scale)
        mn = np.where(take, this_min, mn)
    scale = np.where(flat[:, None], _F32(0), scale)
    q = np.where(flat[:, None], _F32(0), q)
    return scale[:, 0], -mn[:, 0], q


def _pack_k4(ls, lm):
    """(B, 8) 6-bit scales and mins -> (B, 12) bytes (get_scale_min_k4's layout)."""
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    return out


def _encode_q45_k(blocks, nmax, rmin, nstep):
    """(B, 256) -> (d bytes, dmin bytes, (B, 12) scales, (B, 256) codes) of Q4_K / Q5_K."""
    nb = blocks.shape[0]
    x = blocks.reshape(nb * 8, 32)
    w = np.sqrt((x * x).mean(axis=1, keepdims=True)) + np.abs(x)
    scales, mins, q = fit_scale_min(x, w, nmax, rmin, _F32(0.1), nstep)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    top_s, top_m = scales.max(axis=1, keepdims=True), mins.max(axis=1, keepdims=True)
    inv_s = np.where(top_s > 0, _F32(63) / np.where(top_s > 0, top_s, 1), 0)
    inv_m = np.where(top_m > 0, _F32(63) / np.where(top_m > 0, top_m, 1), 0)
    ls = np.minimum(_rint(inv_s * scales), 63).astype(np.uint8)
    lm = np.minimum(_rint(inv_m * mins), 63).astype(np.uint8)
    d, d_bytes = _fp16(top_s / _F32(63))
    dmin, dmin_bytes = _fp16(top_m / _F32(63))
    sub_d = (d * ls).reshape(nb * 8, 1)
    sub_m = (dmin * lm).reshape(nb * 8, 1)
    redo = np.clip(_rint((x + sub_m) / np.where(sub_d == 0, 1, sub_d)), 0, nmax)
    q = np.where(sub_d != 0, redo, q).astype(np.uint8).reshape(nb, QK_K)
    return d_bytes.reshape(nb, 2), dmin_bytes.reshape(nb, 2), _pack_k4(ls, lm), q


def _q4_k(blocks):
    r, nb, _ = blocks.shape
    d, dmin, sc, q = _encode_q45_k(blocks.reshape(r * nb, QK_K), 15, -1.0, 20)
    g = q.reshape(-1, 4, 2, 32)                          # value 64g + 32p + l: nibble p
    qs = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d, dmin, sc, qs], axis=1).reshape(r, nb, 144)


def _q5_k(blocks):
    r, nb, _ = blocks.shape
    d, dmin, sc, q = _encode_q45_k(blocks.reshape(r * nb, QK_K), 31, -0.5, 15)
    g = q.reshape(-1, 4, 2, 32)
    qs = ((g[:, :, 0] & 15) | ((g[:, :, 1] & 15) << 4)).reshape(-1, 128)
    bit = (g >> 4).reshape(-1, 8, 32)                    # high bit of value 32j + l -> bit j
    qh = (bit << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    return np.concatenate([d, dmin, sc, qh, qs], axis=1).reshape(r, nb, 176)


def fit_signed_scale(x, nmax):
    """x (S, n): per row the scale and codes in [-nmax, nmax) of x ~ scale * q, weights x^2,
    searched over 19 candidate scales around -nmax / max (make_qx_quants)."""
    at = np.abs(x).argmax(axis=1)[:, None]
    top = np.take_along_axis(x, at, axis=1)                             # signed (S, 1)
    zero = np.abs(top) < _EPS
    top = np.where(zero, _F32(1), top)
    w = x * x

    def codes(iscale):
        q = np.clip(_rint(iscale * x), -nmax, nmax - 1)
        return q, (w * x * q).sum(axis=1, keepdims=True), (w * q * q).sum(axis=1, keepdims=True)
    q, sumlx, suml2 = codes(-_F32(nmax) / top)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, 1), 0)
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        cand, sx, s2 = codes(-(_F32(nmax) + _F32(0.1) * _F32(step)) / top)
        take = (s2 > 0) & (sx * sx > best * s2)
        q = np.where(take, cand, q)
        scale = np.where(take, sx / np.where(s2 > 0, s2, 1), scale)
        best = np.where(take, scale * sx, best)
    return np.where(zero, 0, scale)[:, 0], np.where(zero, 0, q)


def _q6_k(blocks):
    r, nb, _ = blocks.shape
    x = blocks.reshape(r * nb * 16, 16)
    scales, q = fit_signed_scale(x, 32)
    scales = scales.reshape(-1, 16)
    at = np.abs(scales).argmax(axis=1)[:, None]
    top = np.take_along_axis(scales, at, axis=1)                        # (B, 1) signed
    empty = np.abs(top) < _EPS
    iscale = np.where(empty, 0, _F32(-128) / np.where(empty, 1, top))
    d, d_bytes = _fp16(np.where(empty, 0, 1 / np.where(empty, 1, iscale)))
    sc = np.minimum(127, _rint(iscale * scales)).astype(np.int8)        # (B, 16)
    sub_d = (d * sc).reshape(-1, 1)
    redo = np.clip(_rint(x / np.where(sub_d == 0, 1, sub_d)), -32, 31)
    q = (np.where(sub_d != 0, redo, q) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    q = np.where(empty.reshape(-1, 1, 1, 1), np.uint8(0), q)            # value 128h + 32j + l
    low = q & 15
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)],
                        axis=2).reshape(-1, 128)
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2)
    sc = np.where(empty, np.int8(0), sc)
    return np.concatenate([ql, qh.astype(np.uint8).reshape(-1, 64), sc.view(np.uint8),
                           d_bytes.reshape(-1, 2)], axis=1).reshape(r, nb, 210)


# -- the reference quantizers of the registry (quant/registry.py) ---------------------------------
quantize_q4_k, quantize_q5_k, quantize_q6_k = (row_quantizer(e) for e in (_q4_k, _q5_k, _q6_k))
