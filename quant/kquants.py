"""GGUF/ggml K-quant reference decoders (Q2_K..Q6_K): super-blocks of 256 values, numpy.

A super-block holds 256 consecutive values of a row: fp16 scale(s) and sub-block scales (16
sub-blocks of 16 values for Q2_K/Q3_K/Q6_K, 8 of 32 for Q4_K/Q5_K) and the codes in bit planes.
Where each part sits comes from the format's registry layout; the arrangement of the planes
(which byte and shift hold value v of a super-block) is what ggml's block structs
(ggml-common.h) and dequantize_row_q*_K (ggml-quants.c) define:

  Q4_K / Q5_K  value v = 64g + 32p + l: nibble p of byte qs[32g + l] (Q5_K: high bit g*2 + p of
               qh[l]); x = d * sc[2g+p] * q - dmin * m[2g+p], 6-bit sc/m packed in 12 bytes
  Q6_K         value v = 128h + 32j + l: nibble (j >> 1) of ql[64h + 32(j & 1) + l], 2 high bits
               at shift 2j of qh[32h + l]; x = d * sc[v // 16] * (q - 32), int8 sc
  Q2_K         value v = 128h + 32j + l: bits 2j of qs[32h + l]; x = d * (s & 15) * q - dmin *
               (s >> 4), s = scales[v // 16]
  Q3_K         the Q2_K planes plus high bit (v // 32) of hmask[l] (set: +0, clear: -4);
               x = d * (sc[v // 16] - 32) * q, 6-bit sc packed in 12 bytes
"""
import numpy as np

from .ggml import fp16_from, row_dequantizer

_F32 = np.float32
QK_K = 256


def _col(x):
    return x[..., None]


def scale_min_k4(s):
    """(..., 12) packed bytes -> (sc, m): (..., 8) 6-bit sub-block scales and mins (Q4_K/Q5_K)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 6) << 4)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def scales_q3_k(s):
    """(..., 12) packed bytes -> (..., 16) signed 6-bit sub-block scales of Q3_K."""
    low = np.concatenate([s[..., 0:8] & 15, s[..., 0:8] >> 4], axis=-1)        # (..., 16)
    high = (s[..., 8:12][..., None, :] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    return (low | (high.reshape(*s.shape[:-1], 16) << 4)).astype(np.int16) - 32


def _planes(qs, bits, count):
    """(..., 32n) bytes -> (..., n, count, 32): plane j = (byte >> bits*j) & mask, per group of 32
    bytes (the value order of the 2-bit and 4-bit K-quant planes)."""
    groups = qs.reshape(*qs.shape[:-1], -1, 1, 32)
    shifts = (np.arange(count, dtype=np.uint8) * bits)[:, None]
    return (groups >> shifts) & np.uint8((1 << bits) - 1)


def _half_at(blocks, at):
    return fp16_from(blocks, at)                                                  # (r, nb, 1)


def _decode_q4_k(blocks, layout, high=None):
    """(r, nb, 144) -> (r, nb, 256); Q5_K passes the 32 bytes of high bits."""
    sc, mn = scale_min_k4(blocks[..., layout.sub_scales_at:layout.sub_scales_at + 12])
    q = _planes(blocks[..., layout.codes_at:layout.codes_at + 128], 4, 2)       # (r,nb,4,2,32)
    if high is not None:
        bit = (high[..., None, None, :] >> np.arange(8, dtype=np.uint8).reshape(4, 2, 1)) & 1
        q = q | (bit << 4)
    q = q.reshape(*blocks.shape[:-1], 8, 32).astype(_F32)
    d = _col(_half_at(blocks, layout.scale_at) * sc)
    m = _col(_half_at(blocks, layout.min_at) * mn)
    return (d * q - m).reshape(*blocks.shape[:-1], QK_K)


def _decode_q5_k(blocks, layout):
    high = blocks[..., layout.high_bits_at:layout.high_bits_at + 32]
    return _decode_q4_k(blocks, layout, high)


def _decode_q6_k(blocks, layout):
    ql = blocks[..., layout.codes_at:layout.codes_at + 128].reshape(*blocks.shape[:-1], 2, 2, 32)
    low = np.stack([ql & 15, ql >> 4], axis=-3)                                 # (r,nb,2,2p,2,32)
    low = low.reshape(*blocks.shape[:-1], 2, 4, 32)            # value 128h + 32(2p + i) + l
    qh = blocks[..., layout.high_bits_at:layout.high_bits_at + 64]
    high = _planes(qh, 2, 4)                                                    # (r,nb,2,4,32)
    q = ((low | (high << 4)).astype(np.int16) - 32).reshape(*blocks.shape[:-1], 16, 16)
    sc = blocks[..., layout.sub_scales_at:layout.sub_scales_at + 16].view(np.int8)
    d = _col(_half_at(blocks, layout.scale_at) * sc)
    return (d * q).reshape(*blocks.shape[:-1], QK_K)


def _decode_q2_k(blocks, layout):
    q = _planes(blocks[..., layout.codes_at:layout.codes_at + 64], 2, 4)
    q = q.reshape(*blocks.shape[:-1], 16, 16).astype(_F32)
    s = blocks[..., layout.sub_scales_at:layout.sub_scales_at + 16]
    d = _col(_half_at(blocks, layout.scale_at) * (s & 15))
    m = _col(_half_at(blocks, layout.min_at) * (s >> 4))
    return (d * q - m).reshape(*blocks.shape[:-1], QK_K)


def _decode_q3_k(blocks, layout):
    low = _planes(blocks[..., layout.codes_at:layout.codes_at + 64], 2, 4)      # (r,nb,2,4,32)
    hm = blocks[..., layout.high_bits_at:layout.high_bits_at + 32]
    hbit = (hm[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1     # (r,nb,8,32)
    q = low.reshape(*blocks.shape[:-1], 8, 32).astype(np.int16) - 4 * (1 - hbit.astype(np.int16))
    sc = scales_q3_k(blocks[..., layout.sub_scales_at:layout.sub_scales_at + 12])
    d = _col(_half_at(blocks, layout.scale_at) * sc)
    return (d * q.reshape(*blocks.shape[:-1], 16, 16)).reshape(*blocks.shape[:-1], QK_K)


# -- the reference decoders of the registry (quant/registry.py) ---------------------------------
dequantize_q2_k, dequantize_q3_k, dequantize_q4_k, dequantize_q5_k, dequantize_q6_k = (
    row_dequantizer(d) for d in (_decode_q2_k, _decode_q3_k, _decode_q4_k, _decode_q5_k,
                                 _decode_q6_k))
