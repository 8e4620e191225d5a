"""The SIMD walker's dot in integers: a packed row times x quantized to 8 bits per 32 values.

For generation (one row of x, no gradient) a weight row is dotted with x as llama.cpp does it:
x is cut into chunks of 32, each stored as signed bytes xq with one scale dx (gemv_int.py), and
each chunk of the row multiplies its codes with xq in 8-bit integers, four products summed per
32-bit lane:

  dot = sum_c [ sum_l sc(c, l) * dx_c * (q(c, l) - offset) * xq(c, l) ] + sum_c mn_c * s_c

sc per lane is the chunk's scale (one, or one per 16 lanes for the K-quants' sub-blocks), s_c
the sum of x's quantized values dx_c * xq(c, l) (per sub-block where mins are). Codes come from
the same chunk model as the float walker (simd.chunk_codes); nf4 / fp4 look their nibbles up
in their 16-entry table rounded to 8 bits (TAB_Q), IQ4_NL / IQ4_XS in theirs, whose values are
int8 already; F16 / BF16 stay with the float walker.
The products: AVX-512 VNNI / AVX-VNNI
`vpdpbusd` (u8 x s8), else AVX2 `pmaddubsw` + `pmaddwd`, else plain vector IR. Signed bytes
(Q8_0, int8) go through |w| and x with w's sign, as u8 x s8 needs (|w| <= 128 and |xq| <= 127
keep pmaddubsw's 16-bit pair sums from saturating); a format's code offset (q4_0's 8, Q6_K's
32, ...) joins the min term instead.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...quant import REGISTRY
from ...quant.registry import FLAT
from . import simd_ir as irb
from .chunks import KQ_SCALES, LANES
from .simd import (LAYOUTS, chunk_codes, host_features, iq4_indices, scale_min, sources,
                   tab4_indices)
from .simd_values import sub_scales

# Floats of x's side per chunk (gemv_int.quantize_x): dx, dx * the sums of xq over lanes 0-15,
# 16-31 and all 32.
XS_STRIDE = 4
# Accumulators the chunks of a row take turns in.
ACCS = 4
# A table format's values (within [-1, 1]) as multiples of 1/TAB_Q: nf4's 16 values move by at
# most 1/254 of the block's absmax, ~1/25 of nf4's own spacing.
TAB_Q = 127.0
_TABLES = [e.codebook for e in REGISTRY.values() if e.codebook is not None and e.storage == FLAT]
assert all(max(map(abs, t)) <= 1.0 for t in _TABLES), \
    "a table format's values must lie within [-1, 1] to fit 8 bits as multiples of 1/TAB_Q"
_V8I, _V8F = ir.VectorType(irb.I32, 8), ir.VectorType(irb.F32, 8)
_V32B = ir.VectorType(irb.I8, LANES)


def int_layout(lay):
    """Whether the walker's integer dot takes chunks of this layout: integer codes, or a
    16-entry table (nf4 / fp4, whose values it rounds to 8 bits (TAB_Q); IQ4's int8 values)."""
    return lay.values in ("planes", "q5", "i8", "q4_0", "q4", "tab4", "iq4")


INT_KINDS = tuple(k for k, lay in enumerate(LAYOUTS) if int_layout(lay))


def dot_variant():
    """How four u8 x s8 products are summed per lane on this host: 'vnni', 'avx2' or 'generic'."""
    feats = host_features()
    if (feats.get("avx512vnni") and feats.get("avx512vl")) or feats.get("avxvnni"):
        return "vnni"
    return "avx2" if feats.get("avx2") else "generic"


def _dot4(b, a, x, variant):
    """<8 x i32>: lane i = sum_k a[4i + k] * x[4i + k], a unsigned and x signed bytes."""
    if variant == "vnni":
        zero = ir.Constant(_V8I, [0] * 8)
        return irb.call(b, "llvm.x86.avx512.vpdpbusd.256", _V8I,
                     [zero, b.bitcast(a, _V8I), b.bitcast(x, _V8I)])
    if variant == "avx2":
        v16 = ir.VectorType(ir.IntType(16), 16)
        pairs = irb.call(b, "llvm.x86.avx2.pmadd.ub.sw", v16, [a, x])
        return irb.call(b, "llvm.x86.avx2.pmadd.wd", _V8I, [pairs, ir.Constant(v16, [1] * 16)])
    v32 = ir.VectorType(irb.I32, LANES)
    prod = b.mul(b.zext(a, v32), b.sext(x, v32))
    parts = [b.shuffle_vector(prod, prod, irb.mask(range(k, LANES, 4))) for k in range(4)]
    return b.add(b.add(parts[0], parts[1]), b.add(parts[2], parts[3]))


def _operands(b, q, signed, xv):
    """(u8, s8) operands whose lane products are q * xq (q signed bytes where `signed`)."""
    if not signed:
        return q, xv
    neg = b.icmp_signed("<", q, ir.Constant(_V32B, [0] * LANES))
    zero = ir.Constant(_V32B, [0] * LANES)
    return b.select(neg, b.sub(zero, q), q), b.select(neg, b.sub(zero, xv), xv)


def _with_offset(b, subs, offset):
    """Sub-block (scale, min) pairs with an offset of the codes moved into the min:
    sc * (q - offset) + mn = sc * q + (mn - offset * sc), so unsigned codes stay unsigned."""
    if not offset:
        return subs
    out = []
    for sc, mn in subs:
        shift = b.fmul(sc, ir.Constant(irb.F32, -float(offset)))
        out.append((sc, shift if mn is None else b.fadd(mn, shift)))
    return out


def _scales(b, lay, chunk, src, head, blk):
    """[(scale, min or None)] per sub-block of the chunk (one or two), floats."""
    if lay.scale in KQ_SCALES:
        return sub_scales(b, lay, chunk, src[0], head)
    sc, mn = scale_min(b, lay, chunk, src[:-1], head, blk)  # (without the int8 table)
    if lay.values == "tab4":  # the table's values are multiples of 1 / TAB_Q
        sc = b.fmul(sc, ir.Constant(irb.F32, 1.0 / TAB_Q))
    return [(sc, mn if lay.min_at is not None else None)]


def _int_table(context, b, pkty, pk, lay):
    """The weight's 16 table values (pk's tab) as <16 x i8>: nf4 / fp4's times TAB_Q, rounded;
    IQ4's integers as they are."""
    v16f = ir.VectorType(irb.F32, 16)
    tab = irb.load(b, irb.member(context, b, pkty, pk, 12), v16f, 4)
    if lay.values == "tab4":
        tab = irb.call(b, "llvm.rint.v16f32", v16f, [b.fmul(tab, ir.Constant(v16f,
                                                                             [TAB_Q] * 16))])
    return b.fptosi(tab, ir.VectorType(irb.I8, 16))


def _table_values(b, lay, chunk, codes, head, table, variant):
    """<32 x i8> table values of a TAB4 or IQ4 chunk: a byte shuffle on x86 (pshufb looks up
    each 128-bit half in its own copy of the table), a tree of selects elsewhere."""
    idx = (iq4_indices if lay.values == "iq4" else tab4_indices)(b, chunk, codes, head)
    if variant in ("vnni", "avx2"):
        both = b.shuffle_vector(table, table, irb.mask(list(range(16)) * 2))
        return irb.call(b, "llvm.x86.avx2.pshuf.b", _V32B, [both, idx])
    return irb.select_lookup(b, idx, [irb.splat(b, b.extract_element(table, ir.Constant(
        irb.I32, i))) for i in range(16)])


def _xs(b, xsd, xc, k):
    return irb.loadf(b, xsd, b.add(b.mul(xc, ir.Constant(irb.I64, XS_STRIDE)),
                                   ir.Constant(irb.I64, k)))


def _chunk(b, lay, chunk, src, head, subs, xqd, xsd, xc, variant, accp, minp):
    """One chunk: the integer dot scaled into the <8 x float> accumulator, the min term into
    the scalar one. src: the weight's buffers (simd.sources) and its int8 table."""
    if lay.values in ("tab4", "iq4"):
        q, offset, signed = _table_values(b, lay, chunk, src[0], head, src[-1], variant), 0, True
    else:
        q, offset, signed = chunk_codes(b, lay, chunk, src[0], head)
    subs = _with_offset(b, subs, offset)
    xv = irb.load(b, irb.ptr(b, xqd, b.mul(xc, ir.Constant(irb.I64, LANES)), irb.I8), _V32B, 1)
    isum = _dot4(b, *_operands(b, q, signed, xv), variant)
    dx = _xs(b, xsd, xc, 0)
    lanes = [irb.splat(b, b.fmul(sc, dx), 4) for sc, _ in subs]
    scale = b.shuffle_vector(lanes[0], lanes[-1], irb.mask([0, 1, 2, 3, 4, 5, 6, 7]))
    b.store(irb.call(b, "llvm.fma.v8f32", _V8F, [b.sitofp(isum, _V8F), scale, b.load(accp)]), accp)
    if subs[0][1] is None:
        return
    mins = [(subs[0][1], 3)] if len(subs) == 1 else [(mn, 1 + i) for i, (_, mn) in
                                                     enumerate(subs)]
    m = b.load(minp)
    for mn, k in mins:
        m = b.fadd(m, b.fmul(mn, _xs(b, xsd, xc, k)))
    b.store(m, minp)


def _blocks(b, lay, variant, src, first, count, cb, g0, sh, xqd, xsd, c0, accs):
    """Blocks first .. first + count - 1 (count a constant: unrolled), chunk i of them into
    accumulator pair i % len(accs)."""
    cpb = len(lay.chunks)
    for u in range(count):
        blk = irb.plus(b, first, u)
        head = b.add(cb, b.mul(blk, ir.Constant(irb.I64, lay.stride)))
        c = blk if cpb == 1 else b.mul(blk, ir.Constant(irb.I64, cpb))
        cs = [irb.plus(b, c, j) for j in range(cpb)]
        # every scale of the block first, as in the float walker
        subs = [_scales(b, lay, chunk, src, head, b.lshr(b.add(g0, ci), sh))
                for chunk, ci in zip(lay.chunks, cs)]
        for j, (chunk, ci, sub) in enumerate(zip(lay.chunks, cs, subs)):
            _chunk(b, lay, chunk, src, head, sub, xqd, xsd, b.add(c0, ci), variant,
                   *accs[(u * cpb + j) % len(accs)])


def _body(context, b, lay, variant, pkty, pk, cb, nch, g0, sh, xqd, xsd, c0):
    """The loop over the blocks of `nch` chunks for one chunk layout; returns the dot. Chunks
    go to ACCS accumulators in turn (one would wait on its fused multiply-add's latency), one-
    chunk blocks ACCS to an iteration, the rest one by one."""
    table = _int_table(context, b, pkty, pk, lay) if lay.values in ("tab4", "iq4") else None
    src = (*sources(context, b, pkty, pk, lay), table)
    accs = [(cgutils.alloca_once_value(b, ir.Constant(_V8F, [0.0] * 8)),
             cgutils.alloca_once_value(b, ir.Constant(irb.F32, 0.0))) for _ in range(ACCS)]
    cpb = len(lay.chunks)
    nblk = nch if cpb == 1 else b.udiv(nch, ir.Constant(irb.I64, cpb))
    group = max(1, ACCS // cpb)
    n = ir.Constant(irb.I64, group)
    with cgutils.for_range(b, b.udiv(nblk, n)) as loop:
        _blocks(b, lay, variant, src, b.mul(loop.index, n), group, cb, g0, sh, xqd, xsd, c0,
                accs)
    done = b.mul(b.udiv(nblk, n), n)
    with cgutils.for_range(b, b.sub(nblk, done)) as loop:
        _blocks(b, lay, variant, src, b.add(done, loop.index), 1, cb, g0, sh, xqd, xsd, c0,
                accs)
    acc = b.load(accs[0][0])
    mins = b.load(accs[0][1])
    for vp, mp in accs[1:]:
        acc, mins = b.fadd(acc, b.load(vp)), b.fadd(mins, b.load(mp))
    return b.fadd(irb.hsum(b, acc), mins)


def _emit(variant):
    def codegen(context, b, sig, args):
        kty, pkty, cbt, ncht, g0t, sht, xqt, xst, c0t = sig.args
        kind, pk, cb, nch, g0, sh, xq, xs, c0 = args
        kind, cb, nch, g0, sh, c0 = (context.cast(b, v, t, types.int64) for v, t in (
            (kind, kty), (cb, cbt), (nch, ncht), (g0, g0t), (sh, sht), (c0, c0t)))
        xqd = context.make_array(xqt)(context, b, value=xq).data
        xsd = context.make_array(xst)(context, b, value=xs).data
        res = cgutils.alloca_once_value(b, ir.Constant(irb.F32, 0.0))
        for k in INT_KINDS:
            with b.if_then(b.icmp_signed("==", kind, ir.Constant(irb.I64, k))):
                b.store(_body(context, b, LAYOUTS[k], variant, pkty, pk, cb, nch, g0, sh, xqd,
                              xsd, c0), res)
        return b.load(res)

    return codegen


def make_int_dot(variant=None):
    """A Numba intrinsic run(kind, pk, cb, nch, g0, sh, xq, xs, c0) -> float32: the dot of
    `nch` chunks of kind `kind` (an INT_KINDS entry; others give 0.0) starting at byte cb of
    the weight `pk` with x's chunks c0, c0 + 1, ... (xq int8 (chunks * 32,), xs float32
    (chunks * XS_STRIDE,)). `variant` picks the products (default: the host's best)."""
    variant = variant or dot_variant()

    @intrinsic
    def run(typingctx, kind, pk, cb, nch, g0, sh, xq, xs, c0):
        return types.float32(kind, pk, cb, nch, g0, sh, xq, xs, c0), _emit(variant)

    return run
