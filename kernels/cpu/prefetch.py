"""Software prefetch for the tile decoders: ask the memory system for a packed row ahead of use.

A tile narrower than W reads each of its rows as a separate stretch of bytes a row apart; the
hardware prefetcher ramps up afresh for every one of them, so the decode waited on memory:
Q6_K 4096x11008 in 512x4096 tiles decoded at 3.9 G values/s, whole rows at 10.4. Asking for row
n + 1 while row n decodes keeps the next stretch on its way.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import kernel
from . import simd_ir as irb

LINE = 64  # bytes per cache line on the hosts packlora runs on (x86-64, arm64)
_L2 = 2    # llvm.prefetch locality: 2 = keep in the outer caches (x86 prefetcht1)


@intrinsic
def _prefetch(typingctx, arr, index):
    """llvm.prefetch (read) of the byte at `index` of a 1-D array; never faults."""
    def codegen(context, b, sig, args):
        data = context.make_array(sig.args[0])(context, b, value=args[0]).data
        at = context.cast(b, args[1], sig.args[1], types.int64)
        p = irb.ptr(b, data, at, irb.I8)
        if getattr(p.type, "is_opaque", False):
            name = "llvm.prefetch.p0"
        else:
            p = b.bitcast(p, irb.I8.as_pointer())
            name = "llvm.prefetch.p0i8"
        fn = cgutils.get_or_insert_function(
            b.module, ir.FunctionType(ir.VoidType(), [p.type, irb.I32, irb.I32, irb.I32]), name)
        b.call(fn, [p, ir.Constant(irb.I32, 0), ir.Constant(irb.I32, _L2),
                    ir.Constant(irb.I32, 1)])
        return context.get_dummy_value()
    return types.none(arr, index), codegen


@kernel(inline="always")
def prefetch_bytes(arr, lo, hi):
    """Prefetch the cache lines of arr's bytes [lo, hi) (a uint8 or int8 array)."""
    for at in range(lo, hi, LINE):
        _prefetch(arr, at)
    if hi > lo:
        _prefetch(arr, hi - 1)
