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


def fma(b, x, y, z):
    """x * y + z on <32 x float> vectors, fused."""
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(VF, [VF, VF, VF]),
                                        "llvm.fma.v32f32")
    return b.call(fn, [x, y, z])


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
