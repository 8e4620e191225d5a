"""LLVM IR building blocks of the SIMD walker (simd.py): vectors of 32 float lanes, loads from
Numba arrays' data pointers (typed or opaque), fp16 scalars, fused multiply-adds."""
from llvmlite import ir
from numba.core import cgutils

from .chunks import LANES

F32, F16, I8, I16, I32, I64 = (ir.FloatType(), ir.HalfType(), ir.IntType(8), ir.IntType(16),
                               ir.IntType(32), ir.IntType(64))
VF = ir.VectorType(F32, LANES)


def mask(idx):
    return ir.Constant(ir.VectorType(I32, len(idx)), list(idx))


def splat(b, val, n=LANES):
    vt = ir.VectorType(val.type, n)
    one = b.insert_element(ir.Constant(vt, ir.Undefined), val, ir.Constant(I32, 0))
    return b.shuffle_vector(one, ir.Constant(vt, ir.Undefined), mask([0] * n))


def call(b, name, ret, args):
    """A call of the LLVM function (an intrinsic) `name` returning `ret`, declared from args."""
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, [a.type for a in args]),
                                        name)
    return b.call(fn, args)


def fma(b, x, y, z):
    """x * y + z on <32 x float> vectors, fused."""
    return call(b, "llvm.fma.v32f32", VF, [x, y, z])


def nibbles(b, p):
    """(low, high) nibbles of the 16 bytes at byte pointer p, as two <16 x i8>."""
    v16 = ir.VectorType(I8, 16)
    raw = load(b, p, v16, 1)
    return b.and_(raw, ir.Constant(v16, [15] * 16)), b.lshr(raw, ir.Constant(v16, [4] * 16))


def select_lookup(b, idx, leaves):
    """leaves[idx] lane by lane for an integer vector idx in [0, 16), leaves 16 vectors of
    idx's width: a binary tree of selects on the index bits (no host-specific instruction)."""
    level = list(leaves)
    for bit in range(4):
        on = b.icmp_unsigned("!=", b.and_(idx, ir.Constant(idx.type, [1 << bit] * idx.type.count)),
                             ir.Constant(idx.type, [0] * idx.type.count))
        level = [b.select(on, level[j + 1], level[j]) for j in range(0, len(level), 2)]
    return level[0]


def hsum(b, v):
    """The sum of a vector's lanes, by halving."""
    n = v.type.count
    while n > 1:
        n //= 2
        v = b.fadd(b.shuffle_vector(v, v, mask(range(n))),
                   b.shuffle_vector(v, v, mask(range(n, 2 * n))))
    return b.extract_element(v, ir.Constant(I32, 0))


def ptr(b, data, index, ety):
    """Address of element `index` of a Numba array's data pointer."""
    if getattr(data.type, "is_opaque", False):
        return b.gep(data, [index], source_etype=ety)
    return b.gep(data, [index])


def load(b, ptr, ty, align):
    if getattr(ptr.type, "is_opaque", False):
        return b.load(ptr, typ=ty, align=align)
    return b.load(b.bitcast(ptr, ty.as_pointer()), align=align)


def store(b, val, ptr, align):
    if not getattr(ptr.type, "is_opaque", False):
        ptr = b.bitcast(ptr, val.type.as_pointer())
    b.store(val, ptr, align=align)


def member(context, b, pkty, pk, i):
    """Data pointer of array i of the packed-argument tuple (decode.py)."""
    return context.make_array(pkty.types[i])(context, b, value=b.extract_value(pk, i)).data


def half(b, data, at):
    return b.fpext(b.bitcast(load(b, ptr(b, data, at, I8), I16, 1), F16), F32)


def plus(b, head, offset):
    """head + a constant byte offset."""
    return head if offset == 0 else b.add(head, ir.Constant(I64, offset))


def loadf(b, data, index):
    return load(b, ptr(b, data, index, F32), F32, 4)
