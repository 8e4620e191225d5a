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

from .chunks import LANES, flat_layout, ggml_layout

# Chunk kinds (how 32 consecutive values are stored): indices into LAYOUTS.
Q4_0, Q4_1, Q8_0 = 0, 1, 2  # ggml blocks: fp16 d [, fp16 m], then the codes
TAB4 = 3    # 16 bytes, value 2i in the high nibble of byte i, 2i+1 in the low; a 16-entry table
TAB4DQ = 4  # the same with double-quantized absmax
I8 = 5      # 32 signed bytes, absmax / 127
LAYOUTS = (ggml_layout("q4_0", "q4_0", "f16"), ggml_layout("q4_1", "q4", "f16_min"),
           ggml_layout("q8_0", "i8", "f16"), flat_layout("nf4", "tab4", "absmax"),
           flat_layout("nf4", "tab4", "absmax_dq"), flat_layout("int8", "i8", "absmax_127"))
KINDS = tuple(range(len(LAYOUTS)))
# The chunk kind each format of the registry is walked as (TAB4 turns TAB4DQ with double quant).
FORMAT_KINDS = {"q4_0": Q4_0, "q4_1": Q4_1, "q8_0": Q8_0, "nf4": TAB4, "fp4": TAB4, "int8": I8}
DECODE, DOT, AXPY = 0, 1, 2

_F32, _F16, _I8, _I16, _I32, _I64 = (ir.FloatType(), ir.HalfType(), ir.IntType(8),
                                     ir.IntType(16), ir.IntType(32), ir.IntType(64))
_VF = ir.VectorType(_F32, LANES)


def chunk_kind(fmt, double_quant):
    """The chunk kind of a weight of format `fmt` (a registry name)."""
    kind = FORMAT_KINDS[fmt]
    return TAB4DQ if kind == TAB4 and double_quant else kind


def lookup_variant():
    """How TAB4 maps nibbles to table values on this host: 'avx512', 'avx2' or 'select'."""
    if config.CPU_NAME not in (None, "host"):
        return "select"  # a portable cache was asked for: no host-specific instructions
    feats = llb.get_host_cpu_features()
    if feats.get("avx512f"):
        return "avx512"
    return "avx2" if feats.get("avx2") else "select"


def _mask(idx):
    return ir.Constant(ir.VectorType(_I32, len(idx)), list(idx))


def _splat(b, val, n=LANES):
    vt = ir.VectorType(val.type, n)
    one = b.insert_element(ir.Constant(vt, ir.Undefined), val, ir.Constant(_I32, 0))
    return b.shuffle_vector(one, ir.Constant(vt, ir.Undefined), _mask([0] * n))


def _fma(b, x, y, z):
    """x * y + z on <32 x float> vectors, fused."""
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(_VF, [_VF, _VF, _VF]),
                                        "llvm.fma.v32f32")
    return b.call(fn, [x, y, z])


def _hsum(b, v):
    """The sum of a vector's lanes, by halving."""
    n = v.type.count
    while n > 1:
        n //= 2
        v = b.fadd(b.shuffle_vector(v, v, _mask(range(n))),
                   b.shuffle_vector(v, v, _mask(range(n, 2 * n))))
    return b.extract_element(v, ir.Constant(_I32, 0))


def _ptr(b, data, index, ety):
    """Address of element `index` of a Numba array's data pointer."""
    if getattr(data.type, "is_opaque", False):
        return b.gep(data, [index], source_etype=ety)
    return b.gep(data, [index])


def _load(b, ptr, ty, align):
    if getattr(ptr.type, "is_opaque", False):
        return b.load(ptr, typ=ty, align=align)
    return b.load(b.bitcast(ptr, ty.as_pointer()), align=align)


def _store(b, val, ptr, align):
    if not getattr(ptr.type, "is_opaque", False):
        ptr = b.bitcast(ptr, val.type.as_pointer())
    b.store(val, ptr, align=align)


def _lookup(b, idx, tab, variant):
    """<32 x float> tab[idx] for <32 x i32> idx in [0, 16); tab is <16 x float>."""
    if variant == "avx512":
        fn = cgutils.get_or_insert_function(
            b.module, ir.FunctionType(ir.VectorType(_F32, 16), [ir.VectorType(_F32, 16),
                                                                 ir.VectorType(_I32, 16)]),
            "llvm.x86.avx512.permvar.sf.512")
        halves = [b.call(fn, [tab, b.shuffle_vector(idx, idx, _mask(range(h, h + 16)))])
                  for h in (0, 16)]
        return b.shuffle_vector(halves[0], halves[1], _mask(range(32)))
    if variant == "avx2":
        v8f, v8i = ir.VectorType(_F32, 8), ir.VectorType(_I32, 8)
        fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(v8f, [v8f, v8i]),
                                            "llvm.x86.avx2.permps")
        low = b.shuffle_vector(tab, tab, _mask(range(8)))
        high = b.shuffle_vector(tab, tab, _mask(range(8, 16)))
        parts = []
        for q in range(0, 32, 8):
            i8 = b.shuffle_vector(idx, idx, _mask(range(q, q + 8)))
            upper = b.icmp_unsigned(">", i8, ir.Constant(v8i, [7] * 8))
            parts.append(b.select(upper, b.call(fn, [high, i8]), b.call(fn, [low, i8])))
        lo16 = b.shuffle_vector(parts[0], parts[1], _mask(range(16)))
        hi16 = b.shuffle_vector(parts[2], parts[3], _mask(range(16)))
        return b.shuffle_vector(lo16, hi16, _mask(range(32)))
    # Portable: a binary tree of selects on the index bits, leaves are splatted table entries.
    level = [_splat(b, b.extract_element(tab, ir.Constant(_I32, i))) for i in range(16)]
    vi = ir.VectorType(_I32, LANES)
    for bit in range(4):
        on = b.icmp_unsigned("!=", b.and_(idx, ir.Constant(vi, [1 << bit] * LANES)),
                             ir.Constant(vi, [0] * LANES))
        level = [b.select(on, level[j + 1], level[j]) for j in range(0, len(level), 2)]
    return level[0]


def _values(b, values, codes, at, tab, variant):
    """The 32 code values (before scale) of the chunk whose codes start at byte `at`."""
    p = _ptr(b, codes, at, _I8)
    if values == "i8":
        return b.sitofp(_load(b, p, ir.VectorType(_I8, LANES), 1), _VF)
    v16 = ir.VectorType(_I8, 16)
    raw = _load(b, p, v16, 1)
    lo = b.and_(raw, ir.Constant(v16, [15] * 16))
    hi = b.lshr(raw, ir.Constant(v16, [4] * 16))
    if values in ("q4_0", "q4"):  # ggml: value j in the low nibble of byte j, j + 16 in the high
        q = b.shuffle_vector(lo, hi, _mask(range(32)))
        if values == "q4_0":  # q4_0 stores value + 8: subtract in bytes, no min term afterwards
            return b.sitofp(b.sub(q, ir.Constant(q.type, [8] * LANES)), _VF)
        return b.uitofp(q, _VF)
    inter = [j // 2 + (0 if j % 2 == 0 else 16) for j in range(32)]  # high nibble first
    q = b.zext(b.shuffle_vector(hi, lo, _mask(inter)), ir.VectorType(_I32, LANES))
    return _lookup(b, q, tab, variant)


def _member(context, b, pkty, pk, i):
    """Data pointer of array i of the packed-argument tuple (decode.py)."""
    return context.make_array(pkty.types[i])(context, b, value=b.extract_value(pk, i)).data


def _half(b, data, at):
    return b.fpext(b.bitcast(_load(b, _ptr(b, data, at, _I8), _I16, 1), _F16), _F32)


def _at(b, head, offset):
    return head if offset == 0 else b.add(head, ir.Constant(_I64, offset))


def _scale_min(b, lay, src, head, blk):
    """(scale, min) of a chunk: from the ggml header at byte `head`, or block `blk`'s absmax."""
    codes, absmax, aq, acode, ascale, aoff = src
    if lay.scale == "f16_min":
        return _half(b, codes, _at(b, head, lay.scale_at)), _half(b, codes,
                                                                  _at(b, head, lay.min_at))
    if lay.scale == "f16":
        return _half(b, codes, _at(b, head, lay.scale_at)), ir.Constant(_F32, 0.0)
    if lay.scale == "absmax_dq":
        q = b.zext(_load(b, _ptr(b, aq, blk, _I8), _I8, 1), _I64)
        grp = b.lshr(blk, ir.Constant(_I64, 8))
        s = b.fadd(b.fmul(_loadf(b, acode, q), _loadf(b, ascale, grp)), aoff)
    else:
        s = _loadf(b, absmax, blk)
    if lay.scale == "absmax_127":
        s = b.fmul(s, ir.Constant(_F32, 1.0 / 127.0))
    return s, ir.Constant(_F32, 0.0)


def _loadf(b, data, index):
    return _load(b, _ptr(b, data, index, _F32), _F32, 4)


def _sources(context, b, pkty, pk, lay):
    """(codes, absmax, absmax_q, absmax_code, absmax_scale, absmax_offset) of the weight; flat
    int8 codes are the tuple's int8 array, every other kind reads its uint8 one."""
    codes = 5 if lay.scale == "absmax_127" else 4
    arrays = [_member(context, b, pkty, pk, i) for i in (codes, 6, 7, 8, 9)]
    aoff = _loadf(b, _member(context, b, pkty, pk, 10), ir.Constant(_I64, 0)) \
        if lay.scale == "absmax_dq" else None
    return (*arrays, aoff)


def _check_walkable(lay):
    """The walker decodes whole-byte-plane chunks with a header or absmax scale; other parts of
    the model (nibble planes, high bits, sub-scales) come with the formats that need them."""
    if lay.scale == "sub" or any(c.plane or c.high_at is not None or c.sub_scales
                                 for c in lay.chunks):
        raise NotImplementedError(f"the SIMD walker cannot decode {lay} yet")


def _op(b, op, lay, vals, sc, mn, a, vp, accp, minp):
    """One chunk of `op`: decode into, dot with or accumulate into the 32 floats at vp."""
    if op == DECODE:
        _store(b, _fma(b, _splat(b, sc), vals, _splat(b, mn)), vp, 4)
    elif op == DOT:
        xv = _load(b, vp, _VF, 4)
        b.store(_fma(b, _splat(b, sc), b.fmul(vals, xv), b.load(accp)), accp)
        if lay.min_at is not None:  # the min term on a chain of its own
            b.store(_fma(b, _splat(b, mn), xv, b.load(minp)), minp)
    else:
        out = _fma(b, _splat(b, b.fmul(a, sc)), vals, _load(b, vp, _VF, 4))
        if lay.min_at is not None:
            out = b.fadd(out, _splat(b, b.fmul(a, mn)))
        _store(b, out, vp, 4)


def _body(context, b, op, lay, variant, pkty, pk, cb, nch, g0, sh, a, vdata, vo):
    """The loop over the blocks of `nch` chunks (a whole number of blocks) for one op and chunk
    layout, each block's chunks unrolled at constant offsets; returns the dot (0 otherwise)."""
    _check_walkable(lay)
    src = _sources(context, b, pkty, pk, lay)
    table = _load(b, _member(context, b, pkty, pk, 12), ir.VectorType(_F32, 16), 4) \
        if lay.values == "tab4" else None
    zero = ir.Constant(_VF, [0.0] * LANES)
    accp, minp = (cgutils.alloca_once_value(b, zero) for _ in range(2))
    cpb = len(lay.chunks)
    nblk = nch if cpb == 1 else b.udiv(nch, ir.Constant(_I64, cpb))
    stride = ir.Constant(_I64, lay.stride)
    with cgutils.for_range(b, nblk) as loop:
        head = b.add(cb, b.mul(loop.index, stride))
        c0 = loop.index if cpb == 1 else b.mul(loop.index, ir.Constant(_I64, cpb))
        for j, chunk in enumerate(lay.chunks):
            c = _at(b, c0, j)
            vals = _values(b, lay.values, src[0], _at(b, head, chunk.codes_at), table, variant)
            sc, mn = _scale_min(b, lay, src, head, b.lshr(b.add(g0, c), sh))
            vp = _ptr(b, vdata, b.add(vo, b.mul(c, ir.Constant(_I64, LANES))), _F32)
            _op(b, op, lay, vals, sc, mn, a, vp, accp, minp)
    if op == DOT:
        return _hsum(b, b.fadd(b.load(accp), b.load(minp)))
    return ir.Constant(_F32, 0.0)


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
        res = cgutils.alloca_once_value(b, ir.Constant(_F32, 0.0))
        for k, lay in enumerate(layouts):
            with b.if_then(b.icmp_signed("==", kind, ir.Constant(_I64, k))):
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
