"""PackedWeight: a quantized weight as its raw buffers (numpy or cupy) plus format and shape."""
import functools
import importlib
import math

import numpy as np

from ..errors import QuantError
from .formats import (
    buffer_spec,
    check_buffers,
    check_double_quant,
    check_format,
    check_shape,
    resolve_block_size,
)
from .registry import BY_GGUF_NAME, GGUF_TYPE_NAMES, REGISTRY


def array_module(arr):
    """numpy for numpy arrays (memmaps included), else the array's own package (cupy)."""
    if isinstance(arr, np.ndarray):
        return np
    return _package(type(arr))


@functools.cache
def _package(cls):
    return importlib.import_module(cls.__module__.split(".")[0])


def to_host(arr):
    """A numpy view/copy of a numpy or cupy array (or anything np.asarray takes)."""
    if isinstance(arr, np.ndarray):
        return arr
    return arr.get() if hasattr(arr, "__cuda_array_interface__") else np.asarray(arr)


class PackedWeight:
    """A packed weight: format, logical shape, block_size, double_quant and its buffers.

    The buffers follow the exact layouts of `formats.buffer_spec` (4-bit codes first element in
    the high nibble; GGUF blocks as stored in the file), which the kernels index directly.
    """

    def __init__(self, format, shape, buffers, block_size, double_quant=False):
        fmt = check_format(format)
        self.format = fmt
        self.block_size = resolve_block_size(fmt, block_size)
        self.double_quant = check_double_quant(fmt, double_quant)
        self.shape = check_shape(fmt, shape)
        self.buffers = dict(buffers)
        self._validate()

    def _validate(self):
        check_buffers(self.format, self.shape, self.block_size, self.double_quant, self.buffers)
        modules = {array_module(b).__name__ for b in self.buffers.values()}
        if len(modules) != 1:
            raise QuantError(f"buffers of one PackedWeight live on mixed backends: {modules}")

    # -- construction from GGUF files ----------------------------------------------------------
    @classmethod
    def from_gguf(cls, tensor_type_name, shape, raw):
        """Wrap raw GGUF block bytes (N, nb*BPB) uint8, e.g. a read-only memmap, without copying.

        tensor_type_name: a GGUF type name of the registry ("Q4_0", ...) or a
        GGMLQuantizationType; shape: (N, K).
        """
        entry = BY_GGUF_NAME.get(str(getattr(tensor_type_name, "name", tensor_type_name)).upper())
        if entry is None:
            raise QuantError(f"GGUF tensor type {tensor_type_name!r} cannot be kept packed; "
                             f"supported: {', '.join(GGUF_TYPE_NAMES)}")
        type_name = entry.name
        shape = check_shape(type_name, shape)
        (dtype, want), = buffer_spec(type_name, shape, entry.default_block_size).values()
        if not isinstance(raw, np.ndarray) or raw.dtype != dtype:
            raise QuantError(f"GGUF {type_name.upper()} data must be a uint8 numpy array, got "
                             f"{type(raw).__name__} {getattr(raw, 'dtype', '')}")
        if raw.size != math.prod(want):
            raise QuantError(f"GGUF {type_name.upper()} tensor of shape {shape} needs "
                             f"{math.prod(want)} bytes, got {raw.size}")
        if raw.shape != want:
            if not raw.flags.c_contiguous:
                raise QuantError(f"GGUF {type_name.upper()} data of shape {raw.shape} is not "
                                 f"contiguous; cannot view it as {want} without a copy")
            raw = raw.reshape(want)
        return cls(type_name, shape, {"blocks": raw}, entry.default_block_size)

    # -- properties ------------------------------------------------------------------------------
    @property
    def nbytes(self):
        return int(sum(b.nbytes for b in self.buffers.values()))

    @property
    def xp(self):
        return array_module(next(iter(self.buffers.values())))

    @property
    def numel(self):
        return math.prod(self.shape)

    @property
    def bits_per_weight(self):
        return self.nbytes * 8 / self.numel

    # -- conversions -----------------------------------------------------------------------------
    def dequantize(self):
        """float32 numpy array of `shape` (the test oracle and merge path)."""
        host = {k: to_host(v) for k, v in self.buffers.items()}
        entry = REGISTRY[self.format]
        return entry.dequantize(entry, host, self.shape, self.block_size)

    def to_device(self, dev):
        """This weight with every buffer moved to `dev` (to the host by to_host, to a GPU by
        its xp.asarray), tracked as base_packed."""
        moved = {}
        for key, buf in self.buffers.items():
            moved[key] = to_host(buf) if dev.xp is np else dev.xp.asarray(buf)
            dev.memory.track(moved[key], "base_packed")
        return PackedWeight(self.format, self.shape, moved, self.block_size, self.double_quant)

    def __repr__(self):
        dq = ", double_quant" if self.double_quant else ""
        block = "" if REGISTRY[self.format].fixed_block else f", block_size={self.block_size}"
        return (f"PackedWeight({self.format}, shape={self.shape}{block}{dq}, "
                f"{self.nbytes / 2**20:.2f} MiB, {self.bits_per_weight:.3f} bits/weight, "
                f"{self.xp.__name__})")

