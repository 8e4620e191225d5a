"""packlora.quant: quantization formats (NF4, FP4, INT8, GGUF Q4_0/Q4_1/Q8_0) and PackedWeight."""
from .blockwise import dequantize_absmax
from .codebooks import DYNAMIC_MAP, FP4_CODE, NF4_CODE
from .formats import BLOCK_SIZES, FORMATS, bits_per_weight, packed_nbytes
from .io import load_packed, save_packed
from .packed import PackedWeight
from .quantizer import quantize

__all__ = ["BLOCK_SIZES", "DYNAMIC_MAP", "FORMATS", "FP4_CODE", "NF4_CODE", "PackedWeight",
           "bits_per_weight", "dequantize_absmax", "load_packed", "packed_nbytes", "quantize",
           "save_packed"]
