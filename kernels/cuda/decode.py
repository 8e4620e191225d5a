"""CUDA device functions that decode runs of a packed weight's elements (every format)."""

from numba import cuda, float32, int32

from ...quant import REGISTRY
from ..format_ids import FP4, INT8, NF4, Q4_0, Q4_1, Q8_0
from .bits import signed_byte
from .decode_k import BLOCK_BYTES, BLOCK_ELEMS, block_value, f16_at

__all__ = ["FP4", "INT8", "NF4", "Q4_0", "Q4_1", "Q8_0", "decode_run"]

# The ggml layouts the decoders read, as constants of the compiled kernels.
_Q4_0, _Q4_1, _Q8_0 = (REGISTRY[n].layout for n in ("q4_0", "q4_1", "q8_0"))
Q4_0_CODES = _Q4_0.codes_at
Q4_1_CODES, Q4_1_MIN = _Q4_1.codes_at, _Q4_1.min_at
Q8_0_CODES = _Q8_0.codes_at
GGML_ELEMS = _Q4_0.elems
GGML_SHIFT = GGML_ELEMS.bit_length() - 1
assert GGML_ELEMS == 32 and _Q4_1.elems == _Q8_0.elems == GGML_ELEMS
assert _Q4_0.scale_at == _Q4_1.scale_at == _Q8_0.scale_at == 0


@cuda.jit(device=True, cache=True)
def block_scale(b, fmt, dq, absmax, amq, amcode, amscale, amoff):
    """Scale of flat block b: int8 absmax/127, nf4/fp4 absmax (plain or double-quantized)."""
    if fmt == INT8:
        return absmax[b] / float32(127.0)
    if dq:
        return amcode[amq[b]] * amscale[b >> 8] + amoff[0]
    return absmax[b]


@cuda.jit(device=True, cache=True)
def decode_run_flat(dst, r, c, dr, dc, cnt, i, fmt, bs, dq, q, absmax, amq, amcode, amscale,
                    amoff, codebook):
    """nf4 / fp4 / int8: dst[r + t*dr, c + t*dc] = value(flat element i + t), t < cnt."""
    b = i // bs
    nxt = (b + 1) * bs
    scale = block_scale(b, fmt, dq, absmax, amq, amcode, amscale, amoff)
    for t in range(cnt):
        ii = i + t
        if ii == nxt:
            b += 1
            nxt += bs
            scale = block_scale(b, fmt, dq, absmax, amq, amcode, amscale, amoff)
        if fmt == INT8:
            v = float32(signed_byte(q[ii])) * scale
        else:
            byte = int32(q[ii >> 1])
            code = (byte >> 4) if (ii & 1) == 0 else (byte & 15)
            v = codebook[code] * scale
        dst[r + t * dr, c + t * dc] = v


@cuda.jit(device=True, cache=True)
def decode_run_blocks(dst, r, c, dr, dc, cnt, n, k, kdim, fmt, q, q16):
    """q5_0 / q5_1 / K-quants / f16 / bf16: dst[r + t*dr, c + t*dc] = W[n, k + t], t < cnt."""
    elems = BLOCK_ELEMS[fmt]
    bpb = BLOCK_BYTES[fmt]
    row = n * (kdim // elems) * bpb
    for t in range(cnt):
        kk = k + t
        dst[r + t * dr, c + t * dc] = block_value(q, q16, row + (kk // elems) * bpb, kk % elems,
                                                       fmt)


@cuda.jit(device=True, cache=True)
def decode_run_gguf(dst, r, c, dr, dc, cnt, n, k, kdim, fmt, q, q16):
    """q4_0 / q4_1 / q8_0: dst[r + t*dr, c + t*dc] = W[n, k + t], t < cnt."""
    bpb = BLOCK_BYTES[fmt]
    row = n * (kdim >> GGML_SHIFT) * bpb
    d = float32(0.0)
    m = float32(0.0)
    base = 0
    for t in range(cnt):
        kk = k + t
        j = kk & (GGML_ELEMS - 1)
        if t == 0 or j == 0:
            base = row + (kk >> GGML_SHIFT) * bpb
            d = f16_at(q16, base)
            if fmt == Q4_1:
                m = f16_at(q16, base + Q4_1_MIN)
        if fmt == Q8_0:
            v = float32(signed_byte(q[base + Q8_0_CODES + j])) * d
        else:
            qs = base + (Q4_0_CODES if fmt == Q4_0 else Q4_1_CODES)
            if j < 16:
                v = float32(int32(q[qs + j]) & 15)
            else:
                v = float32(int32(q[qs + j - 16]) >> 4)
            v = (v - float32(8.0)) * d if fmt == Q4_0 else v * d + m
        dst[r + t * dr, c + t * dc] = v


@cuda.jit(device=True, cache=True)
def decode_run(dst, r, c, dr, dc, cnt, n, k, kdim, fmt, bs, dq, q, q16, absmax, amq, amcode,
               amscale, amoff, codebook):
    """dst[r + t*dr, c + t*dc] = W[n, k + t] for t < cnt, any format (W is (N, kdim)). q16 is
    q's float16 view (block formats: their fp16 scales sit at even offsets). Kernels pass fmt
    and dq as constants of their own (launch.py builds one per format), so the compiled decode
    keeps only that format's branch."""
    if cnt <= 0:
        return
    if fmt > Q8_0:
        decode_run_blocks(dst, r, c, dr, dc, cnt, n, k, kdim, fmt, q, q16)
    elif fmt >= Q4_0:
        decode_run_gguf(dst, r, c, dr, dc, cnt, n, k, kdim, fmt, q, q16)
    else:
        decode_run_flat(dst, r, c, dr, dc, cnt, n * kdim + k, fmt, bs, dq, q, absmax, amq,
                        amcode, amscale, amoff, codebook)
