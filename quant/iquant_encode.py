"""Quantizing float rows to IQ4_NL and IQ4_XS in numpy, with the quality of ggml's quantizer
(quantize_row_iq4_nl_impl in ggml-quants.c, no importance matrix), every sub-block of a tensor
at once.

  each 32-value sub-block gets a scale d from a weighted least-squares search (weights x^2):
  codes are the table values (codebooks.IQ4_CODE) nearest x / d for d = max / 127 and for the
  fifteen inverse scales (i - 127) / max, i in -7..7 (which map the largest value onto the
  table's negative end), d refitted to each candidate's codes; the best fit wins
  IQ4_NL   the block's d as fp16, codes nearest x / d
  IQ4_XS   the eight scales as 6-bit signed multiples of fp16 D = -max scale / 32, codes
           nearest x / (D * l)
The byte layouts are the decoders' (quant/iquants.py); gguf.quants decodes the result. The
scale search is numpy here (the reference); packlora.kernels passes a compiled one with the same
signature to `encoders`.
"""
import functools

import numpy as np

from .codebooks import IQ4_CODE
from .ggml import GROUP_MAX_EPS, row_quantizer, signed_max
from .iquants import SUB_ELEMS, pack_codes

_F32 = np.float32
NTRY = 7  # candidate inverse scales (i + IQ4_CODE[0]) / max for i in -NTRY..NTRY


def nearest_code(v):
    """The index of the table value nearest each v (ggml's best_index_int8: ties go up)."""
    hi = np.clip(np.searchsorted(IQ4_CODE, v, side="right"), 1, len(IQ4_CODE) - 1)
    lo = hi - 1
    return np.where(v - IQ4_CODE[lo] < IQ4_CODE[hi] - v, lo, hi).astype(np.uint8)


def _inverse(d):
    with np.errstate(divide="ignore"):
        return np.where(d == 0, _F32(0), _F32(1) / d).astype(_F32)


def _fit(x, w, inv):
    """(sum w q x, sum w q^2), (S, 1) each, of codes nearest x * inv for rows x (S, 32)."""
    q = IQ4_CODE[nearest_code(x * inv)]
    return (w * q * x).sum(axis=1, keepdims=True), (w * q * q).sum(axis=1, keepdims=True)


def fit_scales(x):
    """x (S, 32) -> (S,) float32 scale of each sub-block (0 where it is all zeros)."""
    w = x * x
    mx = signed_max(x)                                                           # (S, 1)
    zero = np.abs(mx) < GROUP_MAX_EPS
    mx = np.where(zero, _F32(1), mx)
    sqx, sq2 = _fit(x, w, _inverse(-mx / IQ4_CODE[0]))
    d = sqx / np.where(sq2 > 0, sq2, _F32(1))
    best = d * sqx
    for i in range(-NTRY, NTRY + 1):
        sqx, sq2 = _fit(x, w, (_F32(i) + IQ4_CODE[0]) / mx)
        take = (sq2 > 0) & (sqx * sqx > best * sq2)
        d = np.where(take, sqx / np.where(sq2 > 0, sq2, _F32(1)), d)
        best = np.where(take, d * sqx, best)
    return np.where(zero, _F32(0), d)[:, 0].astype(_F32)


def _fp16_bytes(v):
    return np.asarray(v, _F32).astype("<f2")[..., None].view(np.uint8)


def _iq4_nl(blocks, fit):
    """(r, nb, 32) float32 -> (r, nb, 18) bytes, scales searched by `fit` (as fit_scales)."""
    x = blocks.reshape(-1, SUB_ELEMS)
    d = fit(x)                                                                    # (S,)
    q = nearest_code(x * _inverse(d)[:, None])
    out = np.concatenate([_fp16_bytes(d), pack_codes(q)], axis=-1)
    return out.reshape(*blocks.shape[:-1], -1)


def _iq4_xs(blocks, fit):
    """(r, nb, 256) float32 -> (r, nb, 136) bytes, scales searched by `fit`."""
    x = blocks.reshape(-1, SUB_ELEMS)
    sc = fit(x).reshape(-1, 8)                                                    # (B, 8)
    top = signed_max(sc)                                                         # (B, 1)
    big = -top / _F32(32)
    ls = np.clip(np.rint(_inverse(big) * sc), -32, 31)                           # (B, 8)
    q = nearest_code(x * _inverse((big * ls).reshape(-1, 1)))                     # (S, 32)
    u = (ls + 32).astype(np.uint8)
    low = u[:, 0::2] & 15 | (u[:, 1::2] & 15) << 4                                # (B, 4)
    high = ((u >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(
        axis=1, dtype=np.uint16)                                                  # (B,)
    out = np.concatenate([_fp16_bytes(big[:, 0]), high.astype("<u2")[:, None].view(np.uint8),
                          low, pack_codes(q.reshape(-1, 8 * SUB_ELEMS))], axis=-1)
    return out.reshape(*blocks.shape[:-1], -1)


def encoders(fit):
    """{format name: block encoder (rows, blocks, B) float32 -> (rows, blocks, BPB) bytes} of
    IQ4_NL and IQ4_XS, their scales searched by `fit`."""
    return {"iq4_nl": functools.partial(_iq4_nl, fit=fit),
            "iq4_xs": functools.partial(_iq4_xs, fit=fit)}


# -- the reference quantizers of the registry (quant/registry.py) ---------------------------------
_REFERENCE = encoders(fit_scales)
quantize_iq4_nl, quantize_iq4_xs = (row_quantizer(_REFERENCE[f]) for f in ("iq4_nl", "iq4_xs"))
