"""The quantization formats: names, block sizes, exact buffer layouts and their byte counts."""
import math

import numpy as np

from ..errors import QuantError

FORMATS = ("nf4", "fp4", "int8", "q4_0", "q4_1", "q8_0")
FOUR_BIT = ("nf4", "fp4")
BLOCKWISE = ("nf4", "fp4", "int8")
GGUF_FORMATS = ("q4_0", "q4_1", "q8_0")
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BLOCK_SIZE = {"nf4": 64, "fp4": 64, "int8": 64, "q4_0": 32, "q4_1": 32, "q8_0": 32}
GGUF_BLOCK = 32
GGUF_BYTES_PER_BLOCK = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
DQ_BLOCK = 256       # double quantization: blocks of 256 absmax values
DQ_CODE_SIZE = 256   # entries of the 8-bit dynamic map stored with the weight


def _who(name):
    return f"tensor {name!r}" if name else "tensor"


def check_format(fmt, name=None):
    """Return the format as a lowercase name, or raise QuantError listing the supported ones."""
    key = str(fmt).lower() if isinstance(fmt, str) else fmt
    if key not in FORMATS:
        raise QuantError(f"unknown quantization format {fmt!r} for {_who(name)}; "
                         f"supported formats: {', '.join(FORMATS)}")
    return key


def resolve_block_size(fmt, block_size, name=None):
    """The block size to use: the format's default for None; QuantError if not allowed."""
    if block_size is None:
        return DEFAULT_BLOCK_SIZE[fmt]
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise QuantError(f"block_size must be an int for {_who(name)}, got {block_size!r}")
    block_size = int(block_size)
    if fmt in GGUF_FORMATS:
        if block_size != GGUF_BLOCK:
            raise QuantError(f"{fmt} always uses blocks of {GGUF_BLOCK}; got block_size="
                             f"{block_size} for {_who(name)}")
    elif block_size not in BLOCK_SIZES:
        raise QuantError(f"block_size {block_size} is not allowed for {fmt} ({_who(name)}); "
                         f"use one of {', '.join(map(str, BLOCK_SIZES))}")
    return block_size


def check_double_quant(fmt, double_quant, name=None):
    if double_quant and fmt not in FOUR_BIT:
        raise QuantError(f"double quantization applies to nf4/fp4 only, not {fmt} "
                         f"({_who(name)})")
    return bool(double_quant)


def check_shape(fmt, shape, name=None):
    """Validate a logical shape for a format; returns it as a tuple of ints."""
    try:
        shape = tuple(int(d) for d in shape)
    except TypeError:
        raise QuantError(f"shape of {_who(name)} must be a tuple of ints, got {shape!r}") from None
    if any(d < 0 for d in shape):
        raise QuantError(f"shape {shape} of {_who(name)} has a negative dimension")
    if math.prod(shape) == 0:
        raise QuantError(f"{_who(name)} is empty (shape {shape}); nothing to quantize")
    if fmt in GGUF_FORMATS:
        if len(shape) != 2:
            raise QuantError(f"{fmt} needs a 2-D (N, K) weight; {_who(name)} has shape {shape}")
        if shape[1] % GGUF_BLOCK:
            raise QuantError(f"{fmt} needs a row length K that is a multiple of {GGUF_BLOCK}; "
                             f"{_who(name)} has shape {shape}")
    return shape


def buffer_spec(fmt, shape, block_size, double_quant=False):
    """Exact layout: {buffer name: (numpy dtype, shape)} for a (validated) format and shape."""
    numel = math.prod(shape)
    if fmt in GGUF_FORMATS:
        n, k = shape
        return {"blocks": (np.dtype(np.uint8), (n, (k // GGUF_BLOCK) * GGUF_BYTES_PER_BLOCK[fmt]))}
    nblocks = -(-numel // block_size)
    if fmt == "int8":
        return {"codes": (np.dtype(np.int8), (numel,)),
                "absmax": (np.dtype(np.float32), (nblocks,))}
    spec = {"codes": (np.dtype(np.uint8), ((numel + 1) // 2,))}
    if not double_quant:
        spec["absmax"] = (np.dtype(np.float32), (nblocks,))
        return spec
    spec["absmax_q"] = (np.dtype(np.uint8), (nblocks,))
    spec["absmax_code"] = (np.dtype(np.float32), (DQ_CODE_SIZE,))
    spec["absmax_scale"] = (np.dtype(np.float32), (-(-nblocks // DQ_BLOCK),))
    spec["absmax_offset"] = (np.dtype(np.float32), (1,))
    return spec


def packed_nbytes(format, shape, block_size=None, double_quant=False):
    """Exact number of bytes `quantize` produces for this format and logical shape."""
    fmt = check_format(format)
    block_size = resolve_block_size(fmt, block_size)
    check_double_quant(fmt, double_quant)
    shape = check_shape(fmt, shape)
    spec = buffer_spec(fmt, shape, block_size, double_quant)
    return sum(dtype.itemsize * math.prod(shp) for dtype, shp in spec.values())


def bits_per_weight(format, block_size=None, double_quant=False):
    """Average storage bits per weight, without per-tensor constants (the 1 KiB dynamic map)."""
    fmt = check_format(format)
    block_size = resolve_block_size(fmt, block_size)
    check_double_quant(fmt, double_quant)
    if fmt in GGUF_FORMATS:
        return GGUF_BYTES_PER_BLOCK[fmt] * 8 / GGUF_BLOCK
    code_bits = 4.0 if fmt in FOUR_BIT else 8.0
    if double_quant:
        return code_bits + 8.0 / block_size + 32.0 / (block_size * DQ_BLOCK)
    return code_bits + 32.0 / block_size
