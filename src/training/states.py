"""Where AdamW keeps its moments: float32 arrays, or 8-bit codes as bitsandbytes' blockwise
8-bit optimizers keep them.

8-bit: blocks of 256 values, each stored as one byte indexing a 256-entry dynamic map (the
signed map for the first moment, the unsigned one for the second) times the block's largest
magnitude, float32. A step decodes a tensor's moments to float32, updates them, and encodes
them again with each block's new largest magnitude. Tensors under 4096 values stay float32
(bitsandbytes' min_8bit_size): their bytes would not be worth the rounding."""
import numpy as np

from ..quant.blockwise import dynamic_quantize
from ..quant.codebooks import DYNAMIC_MAP, DYNAMIC_MAP_UNSIGNED

BLOCK = 256
MIN_8BIT_SIZE = 4096
STATE_BITS = {"adamw": 32, "adamw_8bit": 8}  # train.optimizer -> bits per moment value


def state_nbytes(numel, bits):
    """Bytes one moment of a numel-value tensor takes at `bits` (the plan's price)."""
    if bits == 8 and numel >= MIN_8BIT_SIZE:
        return numel + 4 * -(-numel // BLOCK)
    return 4 * numel


class FloatState:
    """A float32 moment, updated in place."""

    def __init__(self, shape, mem, xp):
        self.array = mem.track(xp.zeros(shape, np.float32))

    def load(self):
        return self.array

    def store(self, value):
        if value is not self.array:
            self.array[...] = value

    def arrays(self, key):
        return {key: self.array}

    def restore(self, arrays, key, xp):
        self.array[...] = xp.asarray(_need(arrays, key))


class BlockState8bit:
    """An 8-bit blockwise moment: codes (N,) uint8 into `code`, absmax (N/256,) float32."""

    def __init__(self, shape, mem, xp, signed):
        self.shape, self.xp = tuple(shape), xp
        n = int(np.prod(shape))
        self.code = xp.asarray(DYNAMIC_MAP if signed else DYNAMIC_MAP_UNSIGNED)
        zero = int(np.flatnonzero(DYNAMIC_MAP == 0)[0]) if signed else 0
        self.codes = mem.track(xp.full(n, zero, np.uint8))
        self.absmax = mem.track(xp.zeros(-(-n // BLOCK), np.float32))

    def load(self):
        """The moment as float32, shaped like its tensor."""
        n = self.codes.size
        values = self.code[self.codes]
        scale = self.xp.repeat(self.absmax, BLOCK)[:n]
        return (values * scale).reshape(self.shape)

    def store(self, value):
        xp, n = self.xp, self.codes.size
        flat = value.reshape(-1)
        pad = -n % BLOCK
        blocks = xp.concatenate([flat, xp.zeros(pad, np.float32)]).reshape(-1, BLOCK)
        absmax = xp.abs(blocks).max(axis=1)
        safe = xp.where(absmax > 0, absmax, np.float32(1))
        self.codes[...] = dynamic_quantize((blocks / safe[:, None]).reshape(-1)[:n], self.code,
                                           xp)
        self.absmax[...] = absmax

    def parts(self):
        """(codes, absmax, map): what a fused update kernel reads and writes."""
        return self.codes, self.absmax, self.code

    def arrays(self, key):
        return {f"{key}.codes": self.codes, f"{key}.absmax": self.absmax}

    def restore(self, arrays, key, xp):
        self.codes[...] = xp.asarray(_need(arrays, f"{key}.codes"))
        self.absmax[...] = xp.asarray(_need(arrays, f"{key}.absmax"))


def make_state(shape, bits, mem, xp, signed):
    if bits == 8 and int(np.prod(shape)) >= MIN_8BIT_SIZE:
        return BlockState8bit(shape, mem, xp, signed)
    return FloatState(shape, mem, xp)


def _need(arrays, key):
    if key not in arrays:
        raise KeyError(f"optimizer state has no {key!r}")
    return arrays[key]
