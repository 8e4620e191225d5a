"""float32 rows <-> the bytes of a GGML tensor type, for the GGUF files packlora writes:
F32, F16, BF16 as such, the quantized types through the format registry's codecs."""
import numpy as np
from gguf import GGMLQuantizationType as GGML

from ..kernels import quantize
from ..quant import BY_GGUF_NAME, PackedWeight
from ..quant.halves import bf16_to_float32, float32_to_bf16


def decode_rows(kind, shape, data):
    """float32 (rows, K) of a tensor's stored bytes (rows, bytes per row) uint8."""
    if kind == GGML.F32:
        return data.view(np.float32).reshape(shape)
    if kind == GGML.F16:
        return data.view(np.float16).reshape(shape).astype(np.float32)
    if kind == GGML.BF16:
        return bf16_to_float32(data.view(np.uint16)).reshape(shape)
    return PackedWeight.from_gguf(kind.name, shape, data).dequantize()


def encode_rows(kind, w, name="weight"):
    """The bytes of float rows w stored as GGML type `kind` (an array to write as is)."""
    if kind == GGML.F32:
        return np.ascontiguousarray(w, np.float32)
    if kind == GGML.F16:
        return w.astype(np.float16)
    if kind == GGML.BF16:
        return float32_to_bf16(w)
    return quantize(w, BY_GGUF_NAME[kind.name].name, name=name).buffers["blocks"]
