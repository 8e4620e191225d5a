"""Reductions over one row of a 2-D float32 array, for row kernels' parallel bodies.

Each is a function of its own so that it can keep `reassoc`, which lets LLVM vectorize a
reduction, while the parallel body that calls it leaves `reassoc` out (BODY_FASTMATH in
fastexp.py says why). That a callee's reduction comes out the same compiled and cached holds
for the ones here as written, not for every reduction: tests/test_kernel_cache.py checks it.
"""
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import kernel
from .fastexp import SAFE_FASTMATH, fexp


@intrinsic
def _maxnum(typingctx, a, b):
    """max(a, b) as LLVM's maxnum: a NaN operand gives the other one (defined without nnan,
    which would make it poison). LLVM vectorizes a reduction over it; Numba's max, which
    branches on NaN, stayed scalar: 49,152 values took 73 us against 6 (a vocabulary's row,
    on an AVX-512 Xeon)."""
    if not (isinstance(a, types.Float) and a == b):
        return None

    def codegen(context, builder, signature, args):
        ty = args[0].type
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty]),
                                            f"llvm.maxnum.f{a.bitwidth}")
        return builder.call(fn, args)
    return a(a, b), codegen


@kernel(fastmath=SAFE_FASTMATH)
def row_max(s, i, n, scale):
    """max of s[i, :n] * scale, n >= 1. A NaN in the row is passed over here; it still makes
    the whole row NaN in the exp pass that follows."""
    m = s[i, 0] * scale
    for j in range(1, n):
        m = _maxnum(m, s[i, j] * scale)
    return m


@kernel(fastmath=SAFE_FASTMATH)
def row_sum(s, i, n):
    """sum of s[i, :n]."""
    acc = np.float32(0.0)
    for j in range(n):
        acc += s[i, j]
    return acc


@kernel(fastmath=SAFE_FASTMATH)
def row_exp_sum(s, i, n, m):
    """sum of exp(s[i, :n] - m), accumulated in float64 (a vocabulary's 10^5 terms). A float32
    sum took half the time, but inlined into cross-entropy's parallel body it trained other
    bits in a process that loaded the kernels from Numba's cache than in one that compiled them."""
    acc = 0.0
    for j in range(n):
        acc += fexp(s[i, j] - m)
    return acc
