"""quantize(array, format, ...) -> PackedWeight: the numpy reference quantizer for every format."""
import numpy as np

from ..errors import QuantError
from .blockwise import quantize_4bit, quantize_int8
from .formats import (
    FOUR_BIT,
    GGUF_FORMATS,
    check_double_quant,
    check_format,
    check_shape,
    resolve_block_size,
)
from .ggml import quantize_ggml
from .packed import PackedWeight, to_host


def _as_float_array(array, name):
    """A numpy float array (no copy when possible); cupy arrays are brought to the host."""
    if not isinstance(array, np.ndarray) and hasattr(array, "__cuda_array_interface__"):
        array = to_host(array)
    array = np.asarray(array)
    if array.dtype.name == "bfloat16":          # ml_dtypes.bfloat16 arrays
        array = array.astype(np.float32)
    if array.dtype.kind != "f":
        raise QuantError(f"tensor {name or '<unnamed>'!r} has dtype {array.dtype}; only float "
                         f"weights (float16/bfloat16-as-float32/float32/float64) can be quantized")
    return array


def quantize(array, format, block_size=None, double_quant=False, name=None):
    """Quantize a float array into `format` ("nf4", "fp4", "int8", "q4_0", "q4_1", "q8_0").

    nf4/fp4/int8 take any shape (blocks run over the row-major flattened tensor); the GGUF
    formats take a 2-D (N, K) weight with K % 32 == 0. Values are rounded to float32 first.
    """
    fmt = check_format(format, name)
    block_size = resolve_block_size(fmt, block_size, name)
    double_quant = check_double_quant(fmt, double_quant, name)
    array = _as_float_array(array, name)
    shape = check_shape(fmt, array.shape, name)
    if fmt in GGUF_FORMATS:
        buffers = quantize_ggml(array, fmt, name)
    elif fmt in FOUR_BIT:
        buffers = quantize_4bit(array.reshape(-1), fmt, block_size, double_quant, name)
    else:
        buffers = quantize_int8(array.reshape(-1), block_size, name)
    return PackedWeight(fmt, shape, buffers, block_size, double_quant)
