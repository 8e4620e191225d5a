"""CUDA device helpers on raw bytes: bf16 values and signed bytes. (fp16 values are read
through a float16 view of the bytes: decode_k.f16_at.)"""
import numpy as np
from numba import config, cuda, int32

if config.ENABLE_CUDASIM:  # the simulator runs device code as Python: numpy reinterprets
    def _int_as_float(i):
        return np.int32(i).view(np.float32)
else:  # one register move on the GPU
    from numba.cuda.libdevice import int_as_float as _int_as_float


@cuda.jit(device=True, cache=True)
def bf16_to_float(lo, hi):
    """bfloat16 (little-endian bytes lo, hi) -> float32: its bits are float32's upper half."""
    return _int_as_float(int32((int32(hi) << 24) | (int32(lo) << 16)))


@cuda.jit(device=True, cache=True)
def signed_byte(v):
    """uint8 -> the int8 with the same bits, as int32."""
    s = int32(v)
    if s >= 128:
        s -= 256
    return s
