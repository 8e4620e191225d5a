"""Explicit SIMD for packed rows: LLVM vector IR emitted through Numba intrinsics.

LLVM does not vectorize the scalar nibble/int8 -> float32 loops by itself (trip counts of 16-32,
unknown aliasing), which left the decoders 5-10x slower than a BLAS GEMV. Here every chunk of 32
consecutive values of a row is decoded as one <32 x float> vector, which LLVM lowers to the host's
widest units (AVX-512, AVX2, NEON, ...). Three operations walk a run of chunks:

  decode: v[vo + 32c + l] = s * val(c, l) + m
  dot:    returns sum_c,l (s * val(c, l) + m) * v[vo + 32c + l]
  axpy:   v[vo + 32c + l] += a * (s * val(c, l) + m)

Where chunks sit is chunks.py's model: blocks `stride` bytes apart, each of one or more chunks
at constant offsets; the ggml kinds read their fp16 scale (and the q4_1 min) from the block
header, the blockwise kinds the absmax of their block (undoing double quantization). One call
covers a whole row span. The layouts of the formats' kinds derive from the format registry.
"""
from llvmlite import binding as llb
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic

from . import simd_ir as irb
from .chunks import (KQ_SCALES, LANES, flat_layout, ggml_layout, half_layout, iq4_xs_layout,
                     kquant_layouts, q5_layout)
from .simd_values import half_values, plane_codes, q5_codes, sub_scale_min, to_float

# Chunk kinds (how 32 consecutive values are stored): indices into LAYOUTS.
Q4_0, Q4_1, Q8_0 = 0, 1, 2  # ggml blocks: fp16 d [, fp16 m], then the codes
TAB4 = 3    # 16 bytes, value 2i in the high nibble of byte i, 2i+1 in the low; a 16-entry table
TAB4DQ = 4  # the same with double-quantized absmax
I8 = 5      # 32 signed bytes, absmax / 127
Q5_0, Q5_1 = 6, 7  # ggml 5-bit blocks of 32
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 8, 9, 10, 11, 12  # K-quant super-blocks of 256: eight chunks
F16, BF16 = 13, 14  # 16-bit floats as stored, no scale
IQ4_NL, IQ4_XS = 15, 16  # q4 nibbles looked up in a 16-value table: blocks of 32, of 256
_KQ = kquant_layouts()
LAYOUTS = (ggml_layout("q4_0", "q4_0", "f16"), ggml_layout("q4_1", "q4", "f16_min"),
           ggml_layout("q8_0", "i8", "f16"), flat_layout("nf4", "tab4", "absmax"),
           flat_layout("nf4", "tab4", "absmax_dq"), flat_layout("int8", "i8", "absmax_127"),
           q5_layout("q5_0", "f16"), q5_layout("q5_1", "f16_min"),
           *(_KQ[n] for n in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")),
           half_layout("f16"), half_layout("bf16"), ggml_layout("iq4_nl", "iq4", "f16"),
           iq4_xs_layout())
KINDS = tuple(range(len(LAYOUTS)))
# The chunk kind each format of the registry is walked as (TAB4 turns TAB4DQ with double quant).
FORMAT_KINDS = {"q4_0": Q4_0, "q4_1": Q4_1, "q8_0": Q8_0, "nf4": TAB4, "fp4": TAB4, "int8": I8,
                "q5_0": Q5_0, "q5_1": Q5_1, "q2_k": Q2_K, "q3_k": Q3_K, "q4_k": Q4_K,
                "q5_k": Q5_K, "q6_k": Q6_K, "f16": F16, "bf16": BF16, "iq4_nl": IQ4_NL,
                "iq4_xs": IQ4_XS}
DECODE, DOT, AXPY = 0, 1, 2


def chunk_kind(fmt, double_quant):
    """The chunk kind of a weight of format `fmt` (a registry name)."""
    kind = FORMAT_KINDS[fmt]
    return TAB4DQ if kind == TAB4 and double_quant else kind


def host_features():
    """The host CPU's features for host-specific instructions; none where a portable cache was
    asked for (NUMBA_CPU_NAME)."""
    if config.CPU_NAME not in (None, "host"):
        return {}
    return llb.get_host_cpu_features()


def lookup_variant():
    """How TAB4 maps nibbles to table values on this host: 'avx512', 'avx2' or 'select'."""
    feats = host_features()
    if feats.get("avx512f"):
        return "avx512"
    return "avx2" if feats.get("avx2") else "select"


def _lookup(b, idx, tab, variant):
    """<32 x float> tab[idx] for <32 x i32> idx in [0, 16); tab is <16 x float>."""
    if variant == "avx512":
        v16f = ir.VectorType(irb.F32, 16)
        halves = [irb.call(b, "llvm.x86.avx512.permvar.sf.512", v16f,
                           [tab, b.shuffle_vector(idx, idx, irb.mask(range(h, h + 16)))])
                  for h in (0, 16)]
        return b.shuffle_vector(halves[0], halves[1], irb.mask(range(32)))
    if variant == "avx2":
        v8f, v8i = ir.VectorType(irb.F32, 8), ir.VectorType(irb.I32, 8)
        low = b.shuffle_vector(tab, tab, irb.mask(range(8)))
        high = b.shuffle_vector(tab, tab, irb.mask(range(8, 16)))
        parts = []
        for q in range(0, 32, 8):
            i8 = b.shuffle_vector(idx, idx, irb.mask(range(q, q + 8)))
            upper = b.icmp_unsigned(">", i8, ir.Constant(v8i, [7] * 8))
            parts.append(b.select(upper, irb.call(b, "llvm.x86.avx2.permps", v8f, [high, i8]),
                                  irb.call(b, "llvm.x86.avx2.permps", v8f, [low, i8])))
        lo16 = b.shuffle_vector(parts[0], parts[1], irb.mask(range(16)))
        hi16 = b.shuffle_vector(parts[2], parts[3], irb.mask(range(16)))
        return b.shuffle_vector(lo16, hi16, irb.mask(range(32)))
    return irb.select_lookup(b, idx, [irb.splat(b, b.extract_element(tab, ir.Constant(
        irb.I32, i))) for i in range(16)])


def chunk_codes(b, lay, chunk, codes, head):
    """(q, offset, signed) of a chunk whose values are integers: its 32 codes as <32 x i8>,
    the value being q - offset (q itself signed bytes where `signed`); None for the table and
    16-bit float kinds."""
    if lay.values == "planes":
        return plane_codes(b, lay, chunk, codes, head), lay.offset, False
    if lay.values == "q5":
        return q5_codes(b, lay, chunk, codes, head), lay.offset, False
    if lay.values not in ("i8", "q4_0", "q4"):
        return None
    p = irb.ptr(b, codes, irb.plus(b, head, chunk.codes_at), irb.I8)
    if lay.values == "i8":
        return irb.load(b, p, ir.VectorType(irb.I8, LANES), 1), 0, True
    lo, hi = irb.nibbles(b, p)
    # ggml: value j in the low nibble of byte j, j + 16 in the high; q4_0 stores value + 8
    return b.shuffle_vector(lo, hi, irb.mask(range(32))), 8 if lay.values == "q4_0" else 0, False


def _values(b, lay, chunk, codes, head, tab, variant):
    """The 32 code values (before scale) of a chunk of the block at byte `head`."""
    ints = chunk_codes(b, lay, chunk, codes, head)
    if ints is not None:
        return to_float(b, *ints)
    if lay.values in ("f16", "bf16"):
        return half_values(b, lay.values, irb.ptr(b, codes, irb.plus(b, head, chunk.codes_at),
                                                  irb.I8))
    idx = iq4_indices(b, chunk, codes, head) if lay.values == "iq4" else \
        tab4_indices(b, chunk, codes, head)
    return _lookup(b, b.zext(idx, ir.VectorType(irb.I32, LANES)), tab, variant)


def tab4_indices(b, chunk, codes, head):
    """<32 x i8> table indices of a TAB4 chunk: value 2i in the high nibble of byte i, 2i+1
    in the low."""
    lo, hi = irb.nibbles(b, irb.ptr(b, codes, irb.plus(b, head, chunk.codes_at), irb.I8))
    inter = [j // 2 + (0 if j % 2 == 0 else 16) for j in range(32)]  # high nibble first
    return b.shuffle_vector(hi, lo, irb.mask(inter))


def iq4_indices(b, chunk, codes, head):
    """<32 x i8> table indices of an IQ4 chunk: ggml's nibble order, value j in the low nibble
    of byte j, j + 16 in the high."""
    lo, hi = irb.nibbles(b, irb.ptr(b, codes, irb.plus(b, head, chunk.codes_at), irb.I8))
    return b.shuffle_vector(lo, hi, irb.mask(range(LANES)))


def scale_min(b, lay, chunk, src, head, blk):
    """(scale, min) of a chunk: from the ggml header at byte `head` (K-quants: its sub-block
    scales), or block `blk`'s absmax."""
    codes, absmax, aq, acode, ascale, aoff = src
    if lay.scale in KQ_SCALES:
        return sub_scale_min(b, lay, chunk, codes, head)
    if lay.scale == "one":  # -0.0: x + -0.0 is x, so the scale and min fold away
        return ir.Constant(irb.F32, 1.0), ir.Constant(irb.F32, -0.0)
    if lay.scale == "f16_min":
        return irb.half(b, codes, irb.plus(b, head, lay.scale_at)), irb.half(b, codes,
                                                                  irb.plus(b, head, lay.min_at))
    if lay.scale == "f16":
        return irb.half(b, codes, irb.plus(b, head, lay.scale_at)), ir.Constant(irb.F32, 0.0)
    if lay.scale == "absmax_dq":
        q = b.zext(irb.load(b, irb.ptr(b, aq, blk, irb.I8), irb.I8, 1), irb.I64)
        grp = b.lshr(blk, ir.Constant(irb.I64, 8))
        s = b.fadd(b.fmul(irb.loadf(b, acode, q), irb.loadf(b, ascale, grp)), aoff)
    else:
        s = irb.loadf(b, absmax, blk)
    if lay.scale == "absmax_127":
        s = b.fmul(s, ir.Constant(irb.F32, 1.0 / 127.0))
    return s, ir.Constant(irb.F32, 0.0)


def sources(context, b, pkty, pk, lay):
    """(codes, absmax, absmax_q, absmax_code, absmax_scale, absmax_offset) of the weight; flat
    int8 codes are the tuple's int8 array, every other kind reads its uint8 one."""
    codes = 5 if lay.scale == "absmax_127" else 4
    arrays = [irb.member(context, b, pkty, pk, i) for i in (codes, 6, 7, 8, 9)]
    aoff = irb.loadf(b, irb.member(context, b, pkty, pk, 10), ir.Constant(irb.I64, 0)) \
        if lay.scale == "absmax_dq" else None
    return (*arrays, aoff)


def _op(b, op, lay, vals, sc, mn, a, vp, accp, minp):
    """One chunk of `op`: decode into, dot with or accumulate into the 32 floats at vp. sc and
    mn are floats (every lane) or vectors (sub-blocks of 16)."""
    sc, mn = (_lanes(b, v) for v in (sc, mn))
    if op == DECODE:
        irb.store(b, irb.fma(b, sc, vals, mn), vp, 4)
    elif op == DOT:
        xv = irb.load(b, vp, irb.VF, 4)
        b.store(irb.fma(b, sc, b.fmul(vals, xv), b.load(accp)), accp)
        if lay.min_at is not None:  # the min term on a chain of its own
            b.store(irb.fma(b, mn, xv, b.load(minp)), minp)
    else:
        av = irb.splat(b, a)
        out = irb.fma(b, b.fmul(av, sc), vals, irb.load(b, vp, irb.VF, 4))
        if lay.min_at is not None:
            out = b.fadd(out, b.fmul(av, mn))
        irb.store(b, out, vp, 4)


def _lanes(b, v):
    return v if isinstance(v.type, ir.VectorType) else irb.splat(b, v)


def _body(context, b, op, lay, variant, pkty, pk, cb, nch, g0, sh, a, vdata, vo):
    """The loop over the blocks of `nch` chunks (a whole number of blocks) for one op and chunk
    layout, each block's chunks unrolled at constant offsets; returns the dot (0 otherwise)."""
    src = sources(context, b, pkty, pk, lay)
    table = irb.load(b, irb.member(context, b, pkty, pk, 12), ir.VectorType(irb.F32, 16), 4) \
        if lay.values in ("tab4", "iq4") else None
    zero = ir.Constant(irb.VF, [0.0] * LANES)
    accp, minp = (cgutils.alloca_once_value(b, zero) for _ in range(2))
    cpb = len(lay.chunks)
    nblk = nch if cpb == 1 else b.udiv(nch, ir.Constant(irb.I64, cpb))
    stride = ir.Constant(irb.I64, lay.stride)
    with cgutils.for_range(b, nblk) as loop:
        head = b.add(cb, b.mul(loop.index, stride))
        c0 = loop.index if cpb == 1 else b.mul(loop.index, ir.Constant(irb.I64, cpb))
        # every scale of the block first: read after the op's first store, LLVM would have to
        # read the header again for each chunk (the output might alias the packed bytes)
        cs = [irb.plus(b, c0, j) for j in range(cpb)]
        scales = [scale_min(b, lay, chunk, src, head, b.lshr(b.add(g0, c), sh))
                  for chunk, c in zip(lay.chunks, cs)]
        for chunk, c, (sc, mn) in zip(lay.chunks, cs, scales):
            vals = _values(b, lay, chunk, src[0], head, table, variant)
            vp = irb.ptr(b, vdata, b.add(vo, b.mul(c, ir.Constant(irb.I64, LANES))), irb.F32)
            _op(b, op, lay, vals, sc, mn, a, vp, accp, minp)
    if op == DOT:
        return irb.hsum(b, b.fadd(b.load(accp), b.load(minp)))
    return ir.Constant(irb.F32, 0.0)


def _emit(variant, op, layouts):
    """Codegen of run(kind, pk, cb, nch, g0, sh, a, v, vo) for `op`: a branch to the loop of the
    runtime chunk kind (an index into `layouts`)."""

    def codegen(context, b, sig, args):
        kty, pkty, cbt, ncht, g0t, sht, at, vt, vot = sig.args
        kind, pk, cb, nch, g0, sh, a, v, vo = args
        kind, cb, nch, g0, sh, vo = (context.cast(b, x, t, types.int64) for x, t in (
            (kind, kty), (cb, cbt), (nch, ncht), (g0, g0t), (sh, sht), (vo, vot)))
        a = context.cast(b, a, at, types.float32)
        vdata = context.make_array(vt)(context, b, value=v).data
        res = cgutils.alloca_once_value(b, ir.Constant(irb.F32, 0.0))
        for k, lay in enumerate(layouts):
            with b.if_then(b.icmp_signed("==", kind, ir.Constant(irb.I64, k))):
                b.store(_body(context, b, op, lay, variant, pkty, pk, cb, nch, g0, sh, a, vdata,
                              vo), res)
        return b.load(res)

    return codegen


def make_dispatch(op, variant=None, layouts=LAYOUTS):
    """A Numba intrinsic run(kind, pk, cb, nch, g0, sh, a, v, vo) -> float32: `op` over `nch`
    chunks of kind `kind` (layouts[kind], whole blocks of it) whose first block starts at byte cb
    of the weight `pk` (decode.py's tuple). Chunk c of a blockwise weight uses absmax block
    (g0 + c) >> sh. `variant` picks the TAB4 lookup (default: the host's best)."""
    variant = variant or lookup_variant()

    @intrinsic
    def run(typingctx, kind, pk, cb, nch, g0, sh, a, v, vo):
        return types.float32(kind, pk, cb, nch, g0, sh, a, v, vo), _emit(variant, op, layouts)

    return run
