"""GGUF/ggml IQ4_NL and IQ4_XS reference decoders, and where their codes and scales sit:
4-bit codes looked up in a 16-value non-linear table (codebooks.IQ4_CODE), numpy.

  IQ4_NL  blocks of 32: fp16 d, then 16 bytes holding code j in the low nibble of byte j and
          code j + 16 in the high one (Q4_0's order); x = d * IQ4_CODE[q]
  IQ4_XS  super-blocks of 256 in eight sub-blocks of 32: fp16 d, a little-endian uint16 holding
          bits 4-5 of sub-block i's 6-bit scale at bits 2i, 4 bytes holding bits 0-3 (sub-block
          i in nibble i % 2 of byte i // 2), then sub-block i's 32 codes in 16 bytes as IQ4_NL's;
          x = d * (scale_i - 32) * IQ4_CODE[q]

ggml's block_iq4_nl / block_iq4_xs (ggml-common.h) and dequantize_row_iq4_* (ggml-quants.c)
define them; the byte offsets are the format's registry layout. IQ4_XS's `sub_scales_at` is
the uint16 of high bits, its 4 bytes of low bits follow it.
"""
import numpy as np

from .codebooks import IQ4_CODE
from .ggml import fp16_from, row_dequantizer

_F32 = np.float32
SUB_ELEMS = 32


def unpack_codes(qs):
    """(..., 16n) bytes -> (..., 32n) codes: sub-block i's code j in the low nibble of byte
    16i + j, code j + 16 in its high nibble."""
    g = qs.reshape(*qs.shape[:-1], -1, 16)
    return np.concatenate([g & np.uint8(15), g >> np.uint8(4)], axis=-1).reshape(
        *qs.shape[:-1], -1)


def pack_codes(q):
    """unpack_codes' inverse: (..., 32n) codes -> (..., 16n) bytes."""
    g = q.reshape(*q.shape[:-1], -1, 2, 16)
    return (g[..., 0, :] | (g[..., 1, :] << np.uint8(4))).reshape(*q.shape[:-1], -1)


def code_bytes(layout):
    """The slice of a block's bytes that holds its codes."""
    return slice(layout.codes_at, layout.codes_at + layout.elems // 2)


def iq4_xs_scales(blocks, at):
    """(..., BPB) bytes -> (..., 8) int16 sub-block scales (the 6-bit scale - 32) of IQ4_XS,
    whose high bits sit in the uint16 at byte `at` and low bits in the 4 bytes after it."""
    high = blocks[..., at].astype(np.int16) | (blocks[..., at + 1].astype(np.int16) << 8)
    low = blocks[..., at + 2:at + 6]
    i = np.arange(8)
    ls = (low[..., i // 2] >> np.uint8(4) * (i % 2).astype(np.uint8)) & np.uint8(15)
    hs = (high[..., None] >> (2 * i).astype(np.int16)) & 3
    return (ls.astype(np.int16) | (hs << 4)) - 32


def element_scales(blocks, layout):
    """(..., BPB) bytes -> (..., elems) float32: what each value's table entry is multiplied
    by (IQ4_NL: d; IQ4_XS: d times its sub-block's scale)."""
    d = fp16_from(blocks, layout.scale_at)                                        # (..., 1)
    if layout.sub_scales_at is None:
        return np.broadcast_to(d, (*blocks.shape[:-1], layout.elems))
    sub = d * iq4_xs_scales(blocks, layout.sub_scales_at).astype(_F32)           # (..., 8)
    return np.repeat(sub, SUB_ELEMS, axis=-1)


def _decode(blocks, layout):
    """(r, nb, BPB) uint8 -> (r, nb, elems) float32."""
    return element_scales(blocks, layout) * IQ4_CODE[unpack_codes(blocks[..., code_bytes(layout)])]


# -- the reference decoders of the registry (quant/registry.py) ---------------------------------
dequantize_iq4_nl = dequantize_iq4_xs = row_dequantizer(_decode)
