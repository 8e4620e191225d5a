"""Checks and sizes of packed weights, read from the format registry: names, block sizes,
shapes, exact buffer layouts (and a weight's buffers against them) and their byte counts."""
import math

import numpy as np

from ..errors import QuantError
from .blockwise import DQ_BLOCK, DQ_CODE_SIZE
from .presets import FALLBACK, PRESETS
from .registry import BLOCK_SIZES, FLAT, FORMATS, GGUF_FORMATS, REGISTRY

__all__ = ["BLOCK_SIZES", "DEFAULT_BLOCK_SIZE", "DQ_BLOCK", "DQ_CODE_SIZE", "FORMATS",
           "GGUF_BYTES_PER_BLOCK", "GGUF_FORMATS", "bits_per_weight", "buffer_spec",
           "check_buffers", "check_double_quant", "check_format", "check_shape", "packed_nbytes",
           "resolve_block_size"]

DEFAULT_BLOCK_SIZE = {n: f.default_block_size for n, f in REGISTRY.items()}
GGUF_BYTES_PER_BLOCK = {n: REGISTRY[n].layout.nbytes for n in GGUF_FORMATS}


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
    entry = REGISTRY[fmt]
    if entry.fixed_block:
        if block_size != entry.default_block_size:
            raise QuantError(f"{fmt} always uses blocks of {entry.default_block_size}; got "
                             f"block_size={block_size} for {_who(name)}")
    elif block_size not in entry.block_sizes:
        raise QuantError(f"block_size {block_size} is not allowed for {fmt} ({_who(name)}); "
                         f"use one of {', '.join(map(str, entry.block_sizes))}")
    return block_size


def check_double_quant(fmt, double_quant, name=None):
    if double_quant and not REGISTRY[fmt].double_quant:
        takes = "/".join(n for n, f in REGISTRY.items() if f.double_quant)
        raise QuantError(f"double quantization applies to {takes} only, not {fmt} "
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
    if REGISTRY[fmt].storage != FLAT:
        elems = REGISTRY[fmt].layout.elems
        if len(shape) != 2:
            raise QuantError(f"{fmt} needs a 2-D (N, K) weight; {_who(name)} has shape {shape}")
        if shape[1] % elems:
            hint = ""
            presets = [p for p, base in PRESETS.items() if base == fmt]
            if presets:
                hint = (f"; the presets {', '.join(presets)} fall back for such rows, as "
                        "llama.cpp does")
            elif fmt in FALLBACK:
                hint = f"; {FALLBACK[fmt]} takes such rows (what llama.cpp falls back to)"
            raise QuantError(f"{fmt} needs a row length K that is a multiple of {elems}; "
                             f"{_who(name)} has shape {shape}{hint}")
    return shape


def buffer_spec(fmt, shape, block_size, double_quant=False):
    """Exact layout: {buffer name: (numpy dtype, shape)} for a (validated) format and shape."""
    entry = REGISTRY[fmt]
    layout = entry.layout
    if entry.storage != FLAT:
        n, k = shape
        return {"blocks": (np.dtype(np.uint8), (n, (k // layout.elems) * layout.nbytes))}
    numel = math.prod(shape)
    nblocks = -(-numel // block_size)
    spec = {"codes": (entry.code_dtype, (-(-numel * layout.code_bits // 8),))}
    if not double_quant:
        spec["absmax"] = (np.dtype(np.float32), (nblocks,))
        return spec
    spec["absmax_q"] = (np.dtype(np.uint8), (nblocks,))
    spec["absmax_code"] = (np.dtype(np.float32), (DQ_CODE_SIZE,))
    spec["absmax_scale"] = (np.dtype(np.float32), (-(-nblocks // DQ_BLOCK),))
    spec["absmax_offset"] = (np.dtype(np.float32), (1,))
    return spec


def check_buffers(fmt, shape, block_size, double_quant, buffers):
    """QuantError unless `buffers` ({name: numpy or cupy array}) are exactly the layout of
    buffer_spec: the same names, dtypes and shapes. The one check of a weight's buffers, made by
    PackedWeight and by both kernel backends before they read raw bytes."""
    check_layout(fmt, shape, block_size, double_quant,
                 {key: (buf.dtype, buf.shape) for key, buf in buffers.items()})


def check_layout(fmt, shape, block_size, double_quant, layout):
    """check_buffers of the buffers' {name: (dtype, shape)}: all the check depends on."""
    spec = buffer_spec(fmt, shape, block_size, double_quant)
    if set(spec) != set(layout):
        raise QuantError(f"{fmt} weight of shape {shape} needs buffers "
                         f"{sorted(spec)}, got {sorted(layout)}")
    for key, (dtype, want) in spec.items():
        got_dtype, got_shape = np.dtype(layout[key][0]), tuple(layout[key][1])
        if got_dtype != dtype or got_shape != want:
            raise QuantError(f"{fmt} buffer {key!r} must be {dtype} {want}, got "
                             f"{got_dtype} {got_shape}")


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
    layout = REGISTRY[fmt].layout
    if REGISTRY[fmt].storage != FLAT:
        return layout.nbytes * 8 / layout.elems
    code_bits = float(layout.code_bits)
    if double_quant:
        return code_bits + 8.0 / block_size + 32.0 / (block_size * DQ_BLOCK)
    return code_bits + 32.0 / block_size
