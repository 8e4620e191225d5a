"""packlora.quant: the format registry (NF4, FP4, INT8, GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the
K-quants Q2_K..Q6_K, F16/BF16 and IQ4_NL/IQ4_XS), numpy reference codecs and PackedWeight."""
from .blockwise import dequantize_absmax
from .codebooks import DYNAMIC_MAP, FP4_CODE, NF4_CODE
from .formats import (
    BLOCK_SIZES,
    FORMATS,
    bits_per_weight,
    buffer_spec,
    check_buffers,
    check_format,
    check_layout,
    packed_nbytes,
)
from .io import load_packed, save_packed
from .packed import PackedWeight
from .quantizer import quantize
from .registry import BY_GGUF_NAME, GGUF_TYPE_NAMES, REGISTRY, BlockLayout, Format

__all__ = ["BLOCK_SIZES", "BY_GGUF_NAME", "DYNAMIC_MAP", "FORMATS", "FP4_CODE", "GGUF_TYPE_NAMES",
           "NF4_CODE", "REGISTRY", "BlockLayout", "Format", "PackedWeight",
           "bits_per_weight", "buffer_spec", "check_buffers", "check_format", "check_layout",
           "dequantize_absmax", "load_packed", "packed_nbytes", "quantize", "save_packed"]
