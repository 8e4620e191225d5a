"""SIMD walker parts for the 5-bit ggml blocks, the K-quant super-blocks (chunks.py) and 16-bit
floats: the 32 codes of a chunk from its bit planes (or its halves), and its sub-block scales
and mins.

Every offset here is a constant of the chunk (its block's layout), so each chunk of a
super-block compiles to a handful of vector ops on bytes and a few scalar ones for its scales.
Scales come back as one float (all 32 lanes) or a <32 x float> of two halves (sub-blocks of 16
values); mins are added (K-quants store dmin * mn subtracted: returned negated).
"""
from llvmlite import ir

from . import simd_ir as irb
from .chunks import LANES

_V8 = ir.VectorType(irb.I8, LANES)


def _bytes(b, codes, at):
    return irb.load(b, irb.ptr(b, codes, at, irb.I8), _V8, 1)


def _vconst(v, ty=_V8):
    return ir.Constant(ty, [v] * ty.count)


def to_float(b, q, offset, signed=False):
    """The values (before scale) of codes q: q - offset, q signed bytes where `signed`."""
    if signed:
        return b.sitofp(q, irb.VF)
    if offset:
        return b.sitofp(b.sub(q, _vconst(offset)), irb.VF)
    return b.uitofp(q, irb.VF)


def plane_codes(b, lay, chunk, codes, head):
    """K-quant codes of a chunk: low bits from a plane of 32 bytes, high bits from another
    (unsigned, before the layout's offset)."""
    q = _bytes(b, codes, irb.plus(b, head, chunk.codes_at))
    if chunk.plane:
        q = b.lshr(q, _vconst(chunk.plane))
    q = b.and_(q, _vconst((1 << lay.code_bits) - 1))
    if lay.high_bits:
        h = _bytes(b, codes, irb.plus(b, head, chunk.high_at))
        if chunk.high_shift:
            h = b.lshr(h, _vconst(chunk.high_shift))
        h = b.and_(h, _vconst((1 << lay.high_bits) - 1))
        q = b.or_(q, b.shl(h, _vconst(lay.code_bits)))
    return q


def q5_codes(b, lay, chunk, codes, head):
    """Q5_0 / Q5_1 codes: ggml's nibble order, bit j of a little-endian uint32 as bit 4
    (unsigned, before the layout's offset)."""
    lo, hi = irb.nibbles(b, irb.ptr(b, codes, irb.plus(b, head, chunk.codes_at), irb.I8))
    q = b.shuffle_vector(lo, hi, irb.mask(range(LANES)))
    bits = irb.load(b, irb.ptr(b, codes, irb.plus(b, head, chunk.high_at), irb.I8), irb.I32, 1)
    v32 = ir.VectorType(irb.I32, LANES)
    high = b.and_(b.lshr(irb.splat(b, bits), ir.Constant(v32, list(range(LANES)))),
                  _vconst(1, v32))
    return b.or_(q, b.shl(b.trunc(high, _V8), _vconst(4)))


def half_values(b, kind, p):
    """32 F16 or BF16 values at byte pointer p, widened to float32."""
    raw = irb.load(b, p, ir.VectorType(irb.I16, LANES), 2)
    if kind == "f16":
        return b.fpext(b.bitcast(raw, ir.VectorType(irb.F16, LANES)), irb.VF)
    v32 = ir.VectorType(irb.I32, LANES)
    return b.bitcast(b.shl(b.zext(raw, v32), _vconst(16, v32)), irb.VF)


def _byte(b, codes, head, offset):
    """The byte at head + offset, as i32."""
    return b.zext(irb.load(b, irb.ptr(b, codes, irb.plus(b, head, offset), irb.I8), irb.I8, 1),
                  irb.I32)


def _bits(b, v, shift, width):
    if shift:
        v = b.lshr(v, ir.Constant(irb.I32, shift))
    return b.and_(v, ir.Constant(irb.I32, (1 << width) - 1))


def _or_high(b, low, high, width):
    return b.or_(low, b.shl(high, ir.Constant(irb.I32, width)))


def _k4(b, codes, at, j):
    """get_scale_min_k4: the 6-bit (scale, min) of sub-block j from the 12 bytes at `at`."""
    def byte(i):
        return _byte(b, codes, at, i)
    if j < 4:
        return _bits(b, byte(j), 0, 6), _bits(b, byte(j + 4), 0, 6)
    sc = _or_high(b, _bits(b, byte(j + 4), 0, 4), _bits(b, byte(j - 4), 6, 2), 4)
    mn = _or_high(b, _bits(b, byte(j + 4), 4, 4), _bits(b, byte(j), 6, 2), 4)
    return sc, mn


def _k3(b, codes, at, i):
    """Q3_K's 6-bit scale i (before its -32) from the 12 bytes at `at`."""
    low = _bits(b, _byte(b, codes, at, i % 8), 4 * (i // 8), 4)
    return _or_high(b, low, _bits(b, _byte(b, codes, at, 8 + i % 4), 2 * (i // 4), 2), 4)


def _iq4_xs(b, codes, at, i):
    """IQ4_XS's 6-bit scale i (before its -32): bits 2i of the uint16 at `at` above nibble
    i % 2 of byte at + 2 + i // 2."""
    low = _bits(b, _byte(b, codes, at, 2 + i // 2), 4 * (i % 2), 4)
    return _or_high(b, low, _bits(b, _byte(b, codes, at, i // 4), 2 * (i % 4), 2), 4)


def _halves(b, lo, hi):
    """<32 x float>: lanes 0-15 lo, 16-31 hi."""
    return b.shuffle_vector(irb.splat(b, lo), irb.splat(b, hi),
                            irb.mask(list(range(16)) + list(range(48, 64))))


def _float(b, v, signed=False):
    return b.sitofp(v, irb.F32) if signed else b.uitofp(v, irb.F32)


def _per_sub(b, lay, chunk, codes, at, d, dmin):
    """(scale, min or None) of each sub-block of the chunk, as floats."""
    out = []
    for i in chunk.sub_scales:
        if lay.scale == "k4":
            sc, mn = _k4(b, codes, at, i)
        elif lay.scale == "k6":
            s = irb.load(b, irb.ptr(b, codes, irb.plus(b, at, i), irb.I8), irb.I8, 1)
            sc, mn = b.sext(s, irb.I32), None
        elif lay.scale == "k2":
            s = _byte(b, codes, at, i)
            sc, mn = _bits(b, s, 0, 4), _bits(b, s, 4, 4)
        elif lay.scale == "k3":
            sc, mn = b.sub(_k3(b, codes, at, i), ir.Constant(irb.I32, 32)), None
        else:  # iq4_xs
            sc, mn = b.sub(_iq4_xs(b, codes, at, i), ir.Constant(irb.I32, 32)), None
        scale = b.fmul(d, _float(b, sc, signed=lay.scale in ("k6", "k3", "iq4_xs")))
        out.append((scale, None if mn is None else b.fneg(b.fmul(dmin, _float(b, mn)))))
    return out


def sub_scales(b, lay, chunk, codes, head):
    """[(scale, min or None)] of each sub-block (one or two) of a K-quant chunk, as floats."""
    d = irb.half(b, codes, irb.plus(b, head, lay.scale_at))
    dmin = None if lay.min_at is None else irb.half(b, codes, irb.plus(b, head, lay.min_at))
    return _per_sub(b, lay, chunk, codes, irb.plus(b, head, lay.sub_scales_at), d, dmin)


def sub_scale_min(b, lay, chunk, codes, head):
    """(scale, min) of a K-quant chunk: floats for one sub-block, vectors for two; min 0.0
    where the format has none."""
    subs = sub_scales(b, lay, chunk, codes, head)
    zero = ir.Constant(irb.F32, 0.0)
    if len(subs) == 1:
        sc, mn = subs[0]
        return sc, zero if mn is None else mn
    (s0, m0), (s1, m1) = subs
    return _halves(b, s0, s1), zero if m0 is None else _halves(b, m0, m1)
