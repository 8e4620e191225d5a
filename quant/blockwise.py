"""Blockwise absmax formats over the flattened tensor: NF4 / FP4 (bitsandbytes, with optional
double quantization of the absmax) and symmetric INT8. Numpy reference quantize and dequantize."""
import numpy as np

from ..errors import QuantError
from .codebooks import DYNAMIC_MAP, FP4_PIVOTS, FP4_RANK_TO_CODE, NF4_PIVOTS

_F32 = np.float32
DQ_BLOCK = 256                 # double quantization: blocks of 256 absmax values
DQ_CODE_SIZE = DYNAMIC_MAP.size  # entries of the 8-bit dynamic map stored with the weight
CHUNK_ELEMS = 1 << 20  # elements quantized at a time (bounds the temporaries to a few MiB)


def check_finite(x, name, base=0):
    """QuantError naming the tensor if x (float32) holds a NaN or Inf."""
    bad = ~np.isfinite(x)
    if bad.any():
        i = int(np.flatnonzero(bad.ravel())[0])
        raise QuantError(f"tensor {name or '<unnamed>'!r} holds a non-finite value "
                         f"({x.ravel()[i]}) at flat index {base + i} (after conversion to "
                         f"float32); NaN/Inf weights cannot be quantized")


def _blocks(flat, start, stop, block_size, name):
    """float32 (nb, block_size) copy of flat[start:stop], the tail block padded with zeros."""
    x = np.asarray(flat[start:stop]).astype(_F32)
    check_finite(x, name, start)
    nb = -(-x.size // block_size)
    if nb * block_size == x.size:
        return x.reshape(nb, block_size)
    out = np.zeros((nb, block_size), _F32)
    out.reshape(-1)[:x.size] = x
    return out


def _scaled(blocks):
    """bitsandbytes' normalisation: absmax per block and x * (1/absmax) in float32.

    An all-zero block gives 1/0 = inf and 0*inf = NaN, as in the CUDA kernel; the code
    search maps those to code 0 there, and so do we.
    """
    absmax = np.abs(blocks).max(axis=1)                       # (nb,)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = _F32(1.0) / absmax
        y = blocks * inv[:, None]                             # (nb, bs)
    return absmax, y


def _count_above(y, pivots):
    """Number of pivots strictly below each y (the bnb trees use `x > pivot`)."""
    codes = np.zeros(y.shape, np.uint8)
    above = np.empty(y.shape, bool)
    for p in pivots:
        np.greater(y, p, out=above)
        codes += above
    return codes


def _nf4_codes(y):
    return _count_above(y, NF4_PIVOTS)


def _fp4_codes(y):
    codes = FP4_RANK_TO_CODE[_count_above(np.abs(y), FP4_PIVOTS)]
    codes |= (y < 0).astype(np.uint8) << 3
    return codes


def quantize_4bit(flat, to_codes, block_size, double_quant, name):
    """Buffers of an nf4/fp4 weight from a flat float array (any float dtype); to_codes maps
    values scaled into [-1, 1] to 4-bit codes."""
    numel = flat.size
    nblocks = -(-numel // block_size)
    codes = np.empty((numel + 1) // 2, np.uint8)
    absmax = np.empty(nblocks, _F32)
    step = max(block_size, CHUNK_ELEMS // block_size * block_size)
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        blocks = _blocks(flat, start, stop, block_size, name)   # (nb, bs)
        bmax, y = _scaled(blocks)
        q = to_codes(y)
        q[~(bmax > 0)] = 0                                     # NaN rows of all-zero blocks
        q = q.reshape(-1)[:stop - start + (stop - start) % 2]  # keep the pad nibble (bnb's)
        codes[start // 2:(stop + 1) // 2] = (q[0::2] << 4) | q[1::2]
        absmax[start // block_size:start // block_size + bmax.size] = bmax
    if not double_quant:
        return {"codes": codes, "absmax": absmax}
    return {"codes": codes, **quantize_absmax(absmax)}


def quantize_int8(flat, block_size, name):
    """Buffers of a symmetric blockwise int8 weight: q = rint(x * 127/absmax)."""
    numel = flat.size
    codes = np.empty(numel, np.int8)
    absmax = np.empty(-(-numel // block_size), _F32)
    step = max(block_size, CHUNK_ELEMS // block_size * block_size)
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        blocks = _blocks(flat, start, stop, block_size, name)
        bmax = np.abs(blocks).max(axis=1)
        with np.errstate(divide="ignore"):
            mult = np.where(bmax > 0, _F32(127) / bmax, _F32(0)).astype(_F32)
        q = np.clip(np.rint(blocks * mult[:, None]), -127, 127).astype(np.int8)
        codes[start:stop] = q.reshape(-1)[:stop - start]
        absmax[start // block_size:start // block_size + bmax.size] = bmax
    return {"codes": codes, "absmax": absmax}


def dynamic_quantize(y, code=DYNAMIC_MAP, xp=np):
    """Index into the sorted 256-entry `code` as bitsandbytes' CUDA dQuantize<0> picks it.

    A 7-step binary search from pivot 127, then the midpoint (in float32) against the neighbour
    on the side x lies: above the pivot value x must exceed the midpoint to move up; below it,
    x must be under the midpoint to move down. NaN lands on index 0, as on the GPU. (The kernel
    also carries the neighbour values; they always equal code[lower_p] and code[upper_p].)
    xp: the array module of y and code (numpy, or cupy for a GPU optimizer's states).
    """
    y = xp.asarray(y, _F32)
    pivot = xp.full(y.shape, 127, xp.int16)
    lower_p = xp.zeros(y.shape, xp.int16)
    upper_p = xp.full(y.shape, 255, xp.int16)
    for i in (64, 32, 16, 8, 4, 2, 1):
        gt = y > code[pivot]
        lower_p = xp.where(gt, pivot, lower_p)
        upper_p = xp.where(gt, upper_p, pivot)
        pivot = xp.where(gt, pivot + i, pivot - i).astype(xp.int16)
    val = code[pivot]
    go_up = y > (code[upper_p] + val) * _F32(0.5)
    go_down = y < (code[lower_p] + val) * _F32(0.5)
    out = xp.where(y > val, xp.where(go_up, upper_p, pivot), xp.where(go_down, lower_p, pivot))
    return out.astype(xp.uint8)


def quantize_absmax(absmax):
    """Double quantization (bnb compress_statistics): absmax - mean, 8-bit dynamic, blocks of 256.

    The mean is taken in float64 and rounded to float32; bitsandbytes sums in float32 on the
    device, so for large tensors its offset can differ from ours in the last bit.
    """
    offset = _F32(np.mean(absmax, dtype=np.float64))
    centered = absmax - offset                                          # (nb,) float32
    blocks = _blocks(centered, 0, centered.size, DQ_BLOCK, "absmax")    # (nb2, 256)
    scale, y = _scaled(blocks)
    q = dynamic_quantize(y).reshape(-1)[:centered.size].copy()   # own its bytes
    return {"absmax_q": q, "absmax_code": DYNAMIC_MAP.copy(), "absmax_scale": scale,
            "absmax_offset": np.array([offset], _F32)}


def dequantize_absmax(pw):
    """float32 absmax per block of an nf4/fp4/int8 PackedWeight (decodes double quantization).

    Works on the buffers' own array module (numpy or cupy)."""
    return absmax_of(pw.buffers, pw.xp, pw.format)


def absmax_of(b, xp, fmt):
    """float32 absmax per block from the buffers b of a `fmt` weight, on the array module xp."""
    if "absmax" in b:
        return b["absmax"]
    if "absmax_q" not in b:
        raise QuantError(f"{fmt} weights have no blockwise absmax (GGUF blocks carry "
                         f"fp16 scales inside `blocks`)")
    q = b["absmax_q"]
    scale_idx = xp.arange(q.shape[0]) // DQ_BLOCK
    return (b["absmax_code"][q] * b["absmax_scale"][scale_idx]
            + b["absmax_offset"][0]).astype(xp.float32)


def _scaled_blocks(shape, vals, scale, block_size):
    """float32 array of `shape`: vals (numel,) times the scale of each one's block."""
    numel = vals.size
    out = np.empty(numel, _F32)
    full = numel // block_size * block_size
    out[:full] = (vals[:full].reshape(-1, block_size) * scale[:full // block_size, None]).ravel()
    if full < numel:
        out[full:] = vals[full:] * scale[-1]
    return out.reshape(shape)


# -- the reference codecs of the registry (quant/registry.py), fmt being the format's entry ----
def quantize_nf4(fmt, array, block_size, double_quant, name):
    return quantize_4bit(array.reshape(-1), _nf4_codes, block_size, double_quant, name)


def quantize_fp4(fmt, array, block_size, double_quant, name):
    return quantize_4bit(array.reshape(-1), _fp4_codes, block_size, double_quant, name)


def quantize_int8_codec(fmt, array, block_size, double_quant, name):
    return quantize_int8(array.reshape(-1), block_size, name)


def dequantize_table4(fmt, buffers, shape, block_size):
    """nf4 / fp4: 4-bit codes (first element in the high nibble) looked up in fmt.codebook."""
    numel = int(np.prod(shape))
    packed = buffers["codes"]
    q = np.empty(packed.size * 2, np.uint8)
    q[0::2] = packed >> 4
    q[1::2] = packed & 0x0F
    absmax = absmax_of(buffers, np, fmt.name)
    return _scaled_blocks(shape, fmt.codebook[q[:numel]], absmax, block_size)


def dequantize_int8(fmt, buffers, shape, block_size):
    absmax = absmax_of(buffers, np, fmt.name)
    return _scaled_blocks(shape, buffers["codes"].astype(_F32), absmax / _F32(127), block_size)
