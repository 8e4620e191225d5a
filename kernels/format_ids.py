"""Kernel format ids: one number per format of the registry, the same on the CPU and CUDA
backends, and the check both make of a weight before they read its raw buffers.

The ids follow the registry's order. Numba bakes them into its on-disk cache, which does not
notice changes in other files: append new formats to the registry, never insert or reorder.
"""
from ..errors import QuantError
from ..quant import REGISTRY, check_buffers

FORMAT_IDS = {name: i for i, name in enumerate(REGISTRY)}
NF4, FP4, INT8, Q4_0, Q4_1, Q8_0 = (FORMAT_IDS[n] for n in
                                    ("nf4", "fp4", "int8", "q4_0", "q4_1", "q8_0"))


def checked_format(w):
    """The registry entry of a 2-D packed weight w whose buffers match the registry's layout;
    QuantError naming what is wrong otherwise."""
    entry = REGISTRY.get(w.format)
    if entry is None:
        raise QuantError(f"unknown packed format {w.format!r}; known: {', '.join(REGISTRY)}")
    if len(w.shape) != 2:
        raise QuantError(f"packed {w.format} weight has shape {tuple(w.shape)}; "
                         "the kernels need 2-D (N, K)")
    check_buffers(w.format, tuple(int(s) for s in w.shape), w.block_size,
                  bool(getattr(w, "double_quant", False)), w.buffers)
    return entry
