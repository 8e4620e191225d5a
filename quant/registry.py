"""The format registry: one entry per packed format, the single place for what a format is.

An entry holds the format's name, its block layout (elements and bytes per block, where the
scale, the min, the high bits and the codes sit), its default and allowed block sizes, its GGUF
type (from the `gguf` package, never retyped), whether it can be quantized from float here and
whether it takes double quantization, and its numpy reference codec. Validation, byte counts,
the config's format names, the loaders, the memory planner and both kernel backends read it.

Adding a format: one entry here (appended: the kernels' format ids follow this order), its
reference codec, its decode routine per kernel backend, and tests.
"""
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as GGML

from .blockwise import (
    dequantize_int8,
    dequantize_table4,
    quantize_fp4,
    quantize_int8_codec,
    quantize_nf4,
)
from .codebooks import FP4_CODE, IQ4_CODE, NF4_CODE
from .ggml import (
    dequantize_q4_0,
    dequantize_q4_1,
    dequantize_q5_0,
    dequantize_q5_1,
    dequantize_q8_0,
    quantize_q4_0,
    quantize_q4_1,
    quantize_q5_0,
    quantize_q5_1,
    quantize_q8_0,
)
from .halves import dequantize_bf16, dequantize_f16, quantize_bf16, quantize_f16
from .iquant_encode import quantize_iq4_nl, quantize_iq4_xs
from .iquants import dequantize_iq4_nl, dequantize_iq4_xs
from .kquant_encode import (
    quantize_q2_k,
    quantize_q3_k,
    quantize_q4_k,
    quantize_q5_k,
    quantize_q6_k,
)
from .kquants import (
    dequantize_q2_k,
    dequantize_q3_k,
    dequantize_q4_k,
    dequantize_q5_k,
    dequantize_q6_k,
)

FLAT = "flat"            # codes of the row-major flattened tensor + an absmax buffer per block
GGML_ROWS = "ggml"       # ggml blocks: scales and codes interleaved, blocks never cross a row
# Block sizes the bitsandbytes-style formats allow (bitsandbytes' own list of block sizes).
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class BlockLayout:
    """Where a block's parts sit. Offsets are bytes from the start of a block in the `blocks`
    buffer (ggml formats); None means the part does not exist or lives in a buffer of its own."""

    elems: int | None          # elements per block; None: the weight's block_size
    nbytes: int | None         # bytes per block; None: codes and scales in separate buffers
    code_bits: int             # bits per stored code
    codes_at: int = 0          # first code byte
    scale_at: int | None = None      # fp16 scale d
    min_at: int | None = None        # fp16 min: m of x = d*q + m (Q4_1, Q5_1), dmin of the
                                     # K-quants' x = d*sc*q - dmin*mn (sub-block sc, mn)
    high_bits_at: int | None = None  # high bits of the codes (Q5_0/Q5_1, Q3_K, Q5_K, Q6_K)
    sub_scales_at: int | None = None  # sub-block scales (K-quant super-blocks)
    sub_elems: int | None = None     # elements per sub-block scale

    def block_bytes(self, block_size):
        """Bytes of one block of `block_size` elements, scales included when interleaved."""
        return self.nbytes if self.nbytes is not None else block_size * self.code_bits // 8


@dataclass(frozen=True)
class Format:
    """One packed format. quantize(fmt, array, block_size, double_quant, name) -> buffers and
    dequantize(fmt, numpy buffers, shape, block_size) -> float32 array are its numpy reference
    codec (the test oracle of every kernel)."""

    name: str
    storage: str               # FLAT or GGML_ROWS
    layout: BlockLayout
    default_block_size: int
    block_sizes: tuple
    quantize: Callable
    dequantize: Callable
    gguf_type: GGML | None = None
    double_quant: bool = False  # takes double quantization of its absmax
    code_dtype: np.dtype = np.dtype(np.uint8)
    codebook: np.ndarray | None = None  # values of 4-bit codes, for table formats
    float16: bool = False      # 16-bit floats as such (F16, BF16): no scales, no grid to keep

    @property
    def gguf_name(self):
        """The GGUF tensor type name ("Q4_0"), or None for formats GGUF does not have."""
        return None if self.gguf_type is None else self.gguf_type.name

    @property
    def fixed_block(self):
        """Whether the block size is part of the format (ggml) rather than a choice."""
        return len(self.block_sizes) == 1


def _blockwise(name, code_bits, codec, **kw):
    layout = BlockLayout(elems=None, nbytes=None, code_bits=code_bits)
    return Format(name, FLAT, layout, 64, BLOCK_SIZES, codec[0], codec[1], **kw)


def _ggml(gguf_type, layout, codec, **kw):
    return Format(gguf_type.name.lower(), GGML_ROWS, layout, layout.elems, (layout.elems,),
                  codec[0], codec[1], gguf_type=gguf_type, **kw)


# F16 / BF16 rows as 32-value "blocks" of their 64 bytes (quant/halves.py).
_HALVES = BlockLayout(32, 64, 16)


REGISTRY = {f.name: f for f in (
    _blockwise("nf4", 4, (quantize_nf4, dequantize_table4),
               double_quant=True, codebook=NF4_CODE),
    _blockwise("fp4", 4, (quantize_fp4, dequantize_table4),
               double_quant=True, codebook=FP4_CODE),
    _blockwise("int8", 8, (quantize_int8_codec, dequantize_int8),
               code_dtype=np.dtype(np.int8)),
    _ggml(GGML.Q4_0, BlockLayout(32, 18, 4, codes_at=2, scale_at=0),
          (quantize_q4_0, dequantize_q4_0)),
    _ggml(GGML.Q4_1, BlockLayout(32, 20, 4, codes_at=4, scale_at=0, min_at=2),
          (quantize_q4_1, dequantize_q4_1)),
    _ggml(GGML.Q8_0, BlockLayout(32, 34, 8, codes_at=2, scale_at=0),
          (quantize_q8_0, dequantize_q8_0)),
    _ggml(GGML.Q5_0, BlockLayout(32, 22, 5, codes_at=6, scale_at=0, high_bits_at=2),
          (quantize_q5_0, dequantize_q5_0)),
    _ggml(GGML.Q5_1, BlockLayout(32, 24, 5, codes_at=8, scale_at=0, min_at=2, high_bits_at=4),
          (quantize_q5_1, dequantize_q5_1)),
    _ggml(GGML.Q2_K, BlockLayout(256, 84, 2, codes_at=16, scale_at=80, min_at=82,
                                 sub_scales_at=0, sub_elems=16), (quantize_q2_k, dequantize_q2_k)),
    _ggml(GGML.Q3_K, BlockLayout(256, 110, 3, codes_at=32, scale_at=108, high_bits_at=0,
                                 sub_scales_at=96, sub_elems=16), (quantize_q3_k, dequantize_q3_k)),
    _ggml(GGML.Q4_K, BlockLayout(256, 144, 4, codes_at=16, scale_at=0, min_at=2,
                                 sub_scales_at=4, sub_elems=32), (quantize_q4_k, dequantize_q4_k)),
    _ggml(GGML.Q5_K, BlockLayout(256, 176, 5, codes_at=48, scale_at=0, min_at=2,
                                 high_bits_at=16, sub_scales_at=4, sub_elems=32),
          (quantize_q5_k, dequantize_q5_k)),
    _ggml(GGML.Q6_K, BlockLayout(256, 210, 6, codes_at=0, scale_at=208, high_bits_at=128,
                                 sub_scales_at=192, sub_elems=16),
          (quantize_q6_k, dequantize_q6_k)),
    _ggml(GGML.F16, _HALVES, (quantize_f16, dequantize_f16), float16=True),
    _ggml(GGML.BF16, _HALVES, (quantize_bf16, dequantize_bf16), float16=True),
    # 4-bit codes looked up in a 16-value table (quant/iquants.py, iquant_encode.py); IQ4_XS's
    # sub-block scales: a uint16 of high bits at sub_scales_at, 4 bytes of low nibbles after it
    _ggml(GGML.IQ4_NL, BlockLayout(32, 18, 4, codes_at=2, scale_at=0),
          (quantize_iq4_nl, dequantize_iq4_nl), codebook=IQ4_CODE),
    _ggml(GGML.IQ4_XS, BlockLayout(256, 136, 4, codes_at=8, scale_at=0, sub_scales_at=2,
                                   sub_elems=32),
          (quantize_iq4_xs, dequantize_iq4_xs), codebook=IQ4_CODE),
)}

FORMATS = tuple(REGISTRY)
GGUF_FORMATS = tuple(n for n, f in REGISTRY.items() if f.storage == GGML_ROWS)
# GGUF tensor type name -> format, for every GGUF type a loader keeps packed.
BY_GGUF_NAME = {f.gguf_name: f for f in REGISTRY.values() if f.gguf_type is not None}
GGUF_TYPE_NAMES = tuple(BY_GGUF_NAME)
DOUBLE_QUANT_FORMATS = tuple(n for n, f in REGISTRY.items() if f.double_quant)
FIXED_BLOCK = {n: f.default_block_size for n, f in REGISTRY.items() if f.fixed_block}
