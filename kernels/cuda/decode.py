"""CUDA device functions that decode runs of a packed weight's elements (every format).

`decode_run` takes any run; `decode_group` a run inside one scale group (the hot loops: runs of
`cnt` values at multiples of cnt where `grouped` holds), which reads its block's scales once
instead of once per value. Kernels pass fmt and dq as constants of their own (launch.py builds
one per format), so the compiled decode keeps only that format's branch."""

from numba import cuda, float32, int32

from ..format_ids import FP4, INT8, NF4, Q4_0, Q4_1, Q8_0
from .bits import signed_byte
from .decode_k import BLOCK_BYTES, BLOCK_ELEMS, SCALE_GROUP, block_affine, block_code

__all__ = ["FP4", "INT8", "NF4", "Q4_0", "Q4_1", "Q8_0", "decode_group", "decode_run",
           "grouped"]
_FLAT_MAX = max(NF4, FP4, INT8)  # format ids up to it are the flat ones (codes + absmax)
assert _FLAT_MAX < min(Q4_0, Q4_1, Q8_0)


def grouped(cnt, bs, kdim):
    """Whether runs of cnt values at multiples of cnt along rows of kdim values lie inside one
    scale group of a format whose blocks hold bs values (PackedWeight.block_size)."""
    return SCALE_GROUP % cnt == 0 and bs % cnt == 0 and kdim % cnt == 0


@cuda.jit(device=True, cache=True)
def block_scale(b, fmt, dq, absmax, amq, amcode, amscale, amoff):
    """Scale of flat block b: int8 absmax/127, nf4/fp4 absmax (plain or double-quantized)."""
    if fmt == INT8:
        return absmax[b] / float32(127.0)
    if dq:
        return amcode[amq[b]] * amscale[b >> 8] + amoff[0]
    return absmax[b]


@cuda.jit(device=True, cache=True)
def _flat_value(q, i, fmt, scale, codebook):
    """Flat element i (nf4 / fp4 / int8) of a block with this scale."""
    if fmt == INT8:
        return float32(signed_byte(q[i])) * scale
    byte = int32(q[i >> 1])
    return codebook[(byte >> 4) if (i & 1) == 0 else (byte & 15)] * scale


@cuda.jit(device=True, cache=True)
def decode_group(dst, r, c, dr, dc, cnt, n, k, kdim, fmt, bs, dq, q, q16, absmax, amq, amcode,
                 amscale, amoff, codebook):
    """decode_run for a run inside one scale group (`grouped(cnt, bs, kdim)`, k a multiple of
    cnt): the block's scales are read once."""
    if fmt <= _FLAT_MAX:
        i = n * kdim + k
        scale = block_scale(i // bs, fmt, dq, absmax, amq, amcode, amscale, amoff)
        for t in range(cnt):
            dst[r + t * dr, c + t * dc] = _flat_value(q, i + t, fmt, scale, codebook)
        return
    elems = BLOCK_ELEMS[fmt]
    bpb = BLOCK_BYTES[fmt]
    base = (n * (kdim // elems) + k // elems) * bpb
    j = k % elems
    s, o = block_affine(q, q16, base, j, fmt)
    for t in range(cnt):
        dst[r + t * dr, c + t * dc] = block_code(q, q16, base, j + t, fmt) * s + o


@cuda.jit(device=True, cache=True)
def decode_run(dst, r, c, dr, dc, cnt, n, k, kdim, fmt, bs, dq, q, q16, absmax, amq, amcode,
               amscale, amoff, codebook):
    """dst[r + t*dr, c + t*dc] = W[n, k + t] for t < cnt, any format (W is (N, kdim)). q16 is
    q's float16 view (block formats: their fp16 scales sit at even offsets)."""
    if cnt <= 0:  # nothing to read (a tile's edge): not even the first block's scale
        return
    if fmt <= _FLAT_MAX:
        i = n * kdim + k
        b = i // bs
        nxt = (b + 1) * bs
        scale = block_scale(b, fmt, dq, absmax, amq, amcode, amscale, amoff)
        for t in range(cnt):
            if i + t == nxt:
                b += 1
                nxt += bs
                scale = block_scale(b, fmt, dq, absmax, amq, amcode, amscale, amoff)
            dst[r + t * dr, c + t * dc] = _flat_value(q, i + t, fmt, scale, codebook)
        return
    for t in range(cnt):  # a block format: each value a group of its own
        decode_group(dst, r + t * dr, c + t * dc, dr, dc, 1, n, k + t, kdim, fmt, bs, dq, q, q16,
                     absmax, amq, amcode, amscale, amoff, codebook)
