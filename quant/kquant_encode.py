"""Quantizing float rows to the K-quants Q2_K ... Q6_K in numpy, with the quality of ggml's
reference quantizer (the iterative searches of quantize_row_q*_K_ref in ggml-quants.c), every
sub-block of a tensor at once.

  Q2_K         each 16-value sub-block gets a scale and a min from the Q4_K search with 2-bit
               codes (weights |x|, absolute rather than squared errors); the sixteen scales and
               mins become 4 bits each against fp16 d = max/15, dmin likewise
  Q3_K         each 16-value sub-block gets a signed scale from -4 / max, then each code is
               moved in turn where that lowers the error (weights x^2, five sweeps); the sixteen
               scales become 6 bits against fp16 d = -max/32
  Q4_K / Q5_K  each 32-value sub-block gets a scale and a min from a weighted least-squares
               search over candidate inverse scales (weights |x| + rms of the sub-block); the
               eight scales and mins are then quantized to 6 bits against the block's largest
               (fp16 d = max/63, dmin likewise) and the codes recomputed with them
  Q6_K         each 16-value sub-block gets a signed scale from a search around -32 / max
               (weights x^2); the sixteen scales become int8 against fp16 d = -max/128
The byte layouts are the decoders' (quant/kquants.py); gguf.quants decodes the result. The
three searches are numpy here (the reference); packlora.kernels passes compiled ones with the
same signatures to `encoders`.
"""
import functools
from typing import Callable, NamedTuple

import numpy as np

from .ggml import GROUP_MAX_EPS, row_quantizer, signed_max
from .kquants import QK_K

_F32 = np.float32


def _rint(v):
    """ggml's nearest_int: round half to even, in float32."""
    return np.rint(v)


def _fp16(v):
    """The float32 value an fp16 store keeps, and its two little-endian bytes."""
    h = np.asarray(v, _F32).astype("<f2")
    return h.astype(_F32), h[..., None].view(np.uint8)


def fit_scale_min(x, w, nmax, rmin, rdelta, nstep, mad=False):
    """x, w (S, n): per row the (scale, min >= 0, codes in [0, nmax]) minimising the weighted
    error of x ~ scale * q - min over nstep + 1 candidate scales (make_qkx2_quants); mad:
    absolute errors, else squared."""
    def error(scale, q, mn):
        diff = scale * q + mn - x
        return (w * (np.abs(diff) if mad else diff * diff)).sum(axis=1, keepdims=True)

    top = x.max(axis=1)[:, None]
    lo = np.minimum(x.min(axis=1), 0)[:, None]                          # (S, 1)
    flat = (top == lo)[:, 0]
    span = np.where(flat[:, None], _F32(1), top - lo)
    sum_w = w.sum(axis=1, keepdims=True)
    sum_x = (w * x).sum(axis=1, keepdims=True)
    iscale = _F32(nmax) / span
    scale = 1 / iscale
    q = np.clip(_rint(iscale * (x - lo)), 0, nmax)
    best = error(scale, q, lo)
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
        err = error(this_scale, cand, this_min)
        take = ok & (err < best) & ~flat[:, None]
        q = np.where(take, cand, q)
        best = np.where(take, err, best)
        scale = np.where(take, this_scale, scale)
        mn = np.where(take, this_min, mn)
    scale = np.where(flat[:, None], _F32(0), scale)
    q = np.where(flat[:, None], _F32(0), q)
    return scale[:, 0], -mn[:, 0], q


def _planes_2bit(q):
    """(B, 256) codes < 4 -> (B, 64) bytes: value 128h + 32j + l at bits 2j of byte 32h + l."""
    g = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    return (g << shifts).sum(axis=2, dtype=np.uint8).reshape(-1, 64)


def _against_top(v, levels):
    """(B, n) sub-block scales (or mins) -> codes in [0, levels] of v / (top / levels), and the
    fp16 top / levels as float32 (B, 1) and as bytes (B, 2); top: the largest, at least 0."""
    top = np.maximum(v.max(axis=1, keepdims=True), 0)
    inv = np.where(top > 0, _F32(levels) / np.where(top > 0, top, 1), 0)
    d, d_bytes = _fp16(top / _F32(levels))
    return np.clip(_rint(inv * v), 0, levels).astype(np.uint8), d, d_bytes.reshape(-1, 2)


def _scale_min_super_blocks(x, w, fit, per_block, levels, nmax, rmin, nstep, mad=False):
    """The super-blocks of Q2_K / Q4_K / Q5_K: sub-blocks x (S, n) fitted by `fit` (as
    fit_scale_min), each super-block's per_block scales and mins made codes against their
    largest (`levels`: 15 or 63), the codes recomputed with them. -> (scale codes, min codes)
    (B, per_block), d bytes, dmin bytes (B, 2), codes (B, 256) uint8."""
    scales, mins, q = fit(x, w, nmax, rmin, _F32(0.1), nstep, mad)
    ls, d, d_bytes = _against_top(scales.reshape(-1, per_block), levels)
    lm, dmin, dmin_bytes = _against_top(mins.reshape(-1, per_block), levels)
    sub_d, sub_m = (d * ls).reshape(-1, 1), (dmin * lm).reshape(-1, 1)
    redo = np.clip(_rint((x + sub_m) / np.where(sub_d == 0, 1, sub_d)), 0, nmax)
    q = np.where(sub_d != 0, redo, q).astype(np.uint8).reshape(-1, QK_K)
    return ls, lm, d_bytes, dmin_bytes, q


def _q2_k(blocks, searches):
    r, nb, _ = blocks.shape
    x = blocks.reshape(r * nb * 16, 16)
    ls, lm, d, dmin, q = _scale_min_super_blocks(x, np.abs(x), searches.scale_min, 16, 15, 3,
                                                 -0.5, 15, mad=True)
    return np.concatenate([ls | (lm << 4), _planes_2bit(q), d, dmin], axis=1).reshape(r, nb, 84)


def fit_q3_scale(x, nmax):
    """x (S, n): per row the scale and codes in [0, 2 nmax) of x ~ scale * (q - nmax), weights
    x^2: codes from -nmax / max, then each moved in turn to its best value for the others while
    that lowers the error, up to five sweeps (make_q3_quants); an all-zero row gets codes 0."""
    top = signed_max(x)                                                 # (S, 1)
    zero = np.abs(top)[:, 0] < GROUP_MAX_EPS
    q = np.clip(_rint(-_F32(nmax) / np.where(zero[:, None], 1, top) * x), -nmax, nmax - 1)
    w = x * x
    sumlx, suml2 = (w * x * q).sum(axis=1), (w * q * q).sum(axis=1)    # (S,)
    for _ in range(5):          # a row that stops changing stays put: no need to stop it early
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], q[:, i]
            slx, sl2 = sumlx - wi * xi * li, suml2 - wi * li * li
            pos = slx > 0
            new = np.clip(_rint(xi * sl2 / np.where(pos, slx, 1)), -nmax, nmax - 1)
            nlx, nl2 = slx + wi * xi * new, sl2 + wi * new * new
            take = pos & (new != li) & (nl2 > 0) & (nlx * nlx * suml2 > sumlx * sumlx * nl2)
            q[:, i] = np.where(take, new, li)
            sumlx, suml2 = np.where(take, nlx, sumlx), np.where(take, nl2, suml2)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, 1), 0)
    return np.where(zero, 0, scale), np.where(zero[:, None], 0, q + nmax)


def _pack_q3_scales(ls):
    """(B, 16) 6-bit scales -> (B, 12) bytes: low nibbles in bytes 0-7 (scale j >= 8 in the high
    nibble of byte j - 8), bits 4-5 of scale j at shift 2 (j // 4) of byte 8 + j % 4."""
    low = (ls[:, :8] & 15) | ((ls[:, 8:] & 15) << 4)
    high = (ls >> 4).reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[None, :, None]
    return np.concatenate([low, high.sum(axis=1, dtype=np.uint8)], axis=1)


def _q3_k(blocks, searches):
    r, nb, _ = blocks.shape
    x = blocks.reshape(r * nb * 16, 16)
    scales, q = searches.q3(x, 4)
    scales = scales.reshape(-1, 16)                                     # (B, 16)
    top = signed_max(scales)                                            # (B, 1)
    empty = top == 0
    iscale = np.where(empty, 0, _F32(-32) / np.where(empty, 1, top))
    ls = (np.clip(_rint(iscale * scales), -32, 31) + 32).astype(np.uint8)
    ls = np.where(empty, np.uint8(0), ls)
    d, d_bytes = _fp16(np.where(empty, 0, 1 / np.where(empty, 1, iscale)))
    sub_d = (d * (ls.astype(np.int16) - 32)).reshape(-1, 1)
    redo = np.clip(_rint(x / np.where(sub_d == 0, 1, sub_d)), -4, 3) + 4
    q = np.where(sub_d != 0, redo, q).astype(np.uint8).reshape(-1, 8, 32)  # value 32b + l
    high = q > 3
    hmask = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    low = np.where(high, q - 4, q).reshape(-1, QK_K)
    return np.concatenate([hmask, _planes_2bit(low), _pack_q3_scales(ls),
                           d_bytes.reshape(-1, 2)], axis=1).reshape(r, nb, 110)


def _pack_k4(ls, lm):
    """(B, 8) 6-bit scales and mins -> (B, 12) bytes (get_scale_min_k4's layout)."""
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    return out


def _encode_q45_k(blocks, fit, nmax, rmin, nstep):
    """(B, 256) -> (d bytes, dmin bytes, (B, 12) scales, (B, 256) codes) of Q4_K / Q5_K."""
    x = blocks.reshape(-1, 32)
    w = np.sqrt((x * x).mean(axis=1, keepdims=True)) + np.abs(x)
    ls, lm, d, dmin, q = _scale_min_super_blocks(x, w, fit, 8, 63, nmax, rmin, nstep)
    return d, dmin, _pack_k4(ls, lm), q


def _q4_k(blocks, searches):
    r, nb, _ = blocks.shape
    d, dmin, sc, q = _encode_q45_k(blocks.reshape(r * nb, QK_K), searches.scale_min, 15, -1.0, 20)
    g = q.reshape(-1, 4, 2, 32)                          # value 64g + 32p + l: nibble p
    qs = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d, dmin, sc, qs], axis=1).reshape(r, nb, 144)


def _q5_k(blocks, searches):
    r, nb, _ = blocks.shape
    d, dmin, sc, q = _encode_q45_k(blocks.reshape(r * nb, QK_K), searches.scale_min, 31, -0.5, 15)
    g = q.reshape(-1, 4, 2, 32)
    qs = ((g[:, :, 0] & 15) | ((g[:, :, 1] & 15) << 4)).reshape(-1, 128)
    bit = (g >> 4).reshape(-1, 8, 32)                    # high bit of value 32j + l -> bit j
    qh = (bit << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    return np.concatenate([d, dmin, sc, qh, qs], axis=1).reshape(r, nb, 176)


def fit_signed_scale(x, nmax):
    """x (S, n): per row the scale and codes in [-nmax, nmax) of x ~ scale * q, weights x^2,
    searched over 19 candidate scales around -nmax / max (make_qx_quants)."""
    top = signed_max(x)                                                 # (S, 1)
    zero = np.abs(top) < GROUP_MAX_EPS
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


def _q6_k(blocks, searches):
    r, nb, _ = blocks.shape
    x = blocks.reshape(r * nb * 16, 16)
    scales, q = searches.signed(x, 32)
    scales = scales.reshape(-1, 16)
    top = signed_max(scales)                                            # (B, 1)
    empty = np.abs(top) < GROUP_MAX_EPS
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


class Searches(NamedTuple):
    """The per-sub-block searches the encoders run, each with the signature of its numpy one."""
    scale_min: Callable   # fit_scale_min: Q2_K, Q4_K, Q5_K
    q3: Callable          # fit_q3_scale: Q3_K
    signed: Callable      # fit_signed_scale: Q6_K


NUMPY_SEARCHES = Searches(fit_scale_min, fit_q3_scale, fit_signed_scale)


def encoders(searches):
    """{format name: block encoder (rows, blocks, 256) float32 -> (rows, blocks, BPB) bytes}
    of the K-quants, running `searches`."""
    return {name: functools.partial(encode, searches=searches) for name, encode in
            (("q2_k", _q2_k), ("q3_k", _q3_k), ("q4_k", _q4_k), ("q5_k", _q5_k), ("q6_k", _q6_k))}


# -- the reference quantizers of the registry (quant/registry.py) ---------------------------------
_REFERENCE = encoders(NUMPY_SEARCHES)
quantize_q2_k, quantize_q3_k, quantize_q4_k, quantize_q5_k, quantize_q6_k = (
    row_quantizer(_REFERENCE[f"q{b}_k"]) for b in range(2, 7))
