"""quantize(array, format, ...) -> PackedWeight: the numpy reference quantizer for every format."""
import numpy as np

from ..errors import QuantError
from .formats import check_double_quant, check_format, check_shape, resolve_block_size
from .ggml import quantize_rows
from .packed import PackedWeight, to_host
from .registry import REGISTRY


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


def quantize(array, format, block_size=None, double_quant=False, name=None, encoders=None):
    """Quantize a float array into `format` (a name of quant.FORMATS: "nf4", "q4_0", ...).

    nf4/fp4/int8 take any shape (blocks run over the row-major flattened tensor); the GGUF
    formats take a 2-D (N, K) weight with K a multiple of their block (32). Values are rounded
    to float32 first. encoders: {format name: block encoder} used for those GGUF formats instead
    of the registry's numpy reference (packlora.kernels.quantize passes its compiled ones).
    """
    fmt = check_format(format, name)
    block_size = resolve_block_size(fmt, block_size, name)
    double_quant = check_double_quant(fmt, double_quant, name)
    entry = REGISTRY[fmt]
    array = _as_float_array(array, name)
    shape = check_shape(fmt, array.shape, name)
    encode = (encoders or {}).get(fmt)
    buffers = (quantize_rows(entry, array, name, encode) if encode is not None
               else entry.quantize(entry, array, block_size, double_quant, name))
    return PackedWeight(fmt, shape, buffers, block_size, double_quant)
