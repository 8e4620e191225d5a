"""Kernel format ids: one number per format of the registry, the same on the CPU and CUDA
backends, and the checks both make of a weight before they read its raw buffers (its layout,
and that it lives where its input does).

The ids follow the registry's order. Numba bakes them into its on-disk cache, which does not
notice changes in other files: append new formats to the registry, never insert or reorder.
"""
import functools

from ..errors import DeviceError, QuantError
from ..quant import REGISTRY, check_layout

FORMAT_IDS = {name: i for i, name in enumerate(REGISTRY)}
NF4, FP4, INT8, Q4_0, Q4_1, Q8_0 = (FORMAT_IDS[n] for n in
                                    ("nf4", "fp4", "int8", "q4_0", "q4_1", "q8_0"))


def checked_format(w):
    """The registry entry of a 2-D packed weight w whose buffers match the registry's layout;
    QuantError naming what is wrong otherwise. Run on every product: the check depends only on
    the weight's format, shape, blocking and its buffers' dtypes and shapes, so it is made once
    for each of those (4 -> 1.3 us a call for NF4 + DQ)."""
    layout = tuple([(name, b.dtype, b.shape) for name, b in w.buffers.items()])
    return _checked(w.format, tuple(w.shape), w.block_size,
                    bool(getattr(w, "double_quant", False)), layout)


@functools.lru_cache(maxsize=1024)
def _checked(fmt, shape, block_size, double_quant, layout):
    entry = REGISTRY.get(fmt)
    if entry is None:
        raise QuantError(f"unknown packed format {fmt!r}; known: {', '.join(REGISTRY)}")
    if len(shape) != 2:
        raise QuantError(f"packed {fmt} weight has shape {shape}; the kernels need 2-D (N, K)")
    check_layout(fmt, tuple(int(s) for s in shape), block_size, double_quant,
                 {name: (dtype, shp) for name, dtype, shp in layout})
    return entry


def wrong_device(w, input_on_gpu):
    """The DeviceError for packed weight w used with an input on the other device."""
    where = "GPU (cupy)" if input_on_gpu else "host (numpy)"
    return DeviceError(f"packed weight ({w.format}, shape {tuple(w.shape)}) is not on the "
                       f"input's device {where}; move it with w.to_device(dev)")
