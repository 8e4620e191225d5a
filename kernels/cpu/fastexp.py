"""exp for Numba kernels that LLVM can vectorize: float32 gets Cody-Waite range reduction and a
degree-6 polynomial (≈1-2 ulp, as numpy's), float64 keeps math.exp. libm's scalar expf is what
made SwiGLU, cross-entropy and softmax 3-4x slower than their memory traffic.

NaN stays NaN, -inf and underflow give 0, overflow gives inf. Kernels that call fexp should not
use the nnan/ninf fast-math flags (see SAFE_FASTMATH), or NaN could be folded away.
"""
import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from . import kernel

SAFE_FASTMATH = {"contract", "afn", "reassoc", "nsz", "arcp"}
# Arithmetic in a parallel loop's body leaves reassoc out. Numba keeps two copies of that body:
# the one the process that compiled it runs (optimized once), and the one in its on-disk cache
# (optimized again inside the calling function). LLVM's reassociation of an expression need
# not come out the same the second time, so a run that compiled its kernels and a run that
# loaded them from the cache differed in the last bit (a third of SwiGLU backward's values,
# softmax rows, decoding's one-query attention). A sum that needs reassoc to vectorize keeps
# it, in a loop of its own. tests/test_kernel_cache.py checks a training step's bits both ways.
BODY_FASTMATH = SAFE_FASTMATH - {"reassoc"}

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_HI = np.float32(88.72283)   # exp overflows float32 above this
_LO = np.float32(-87.33654)  # below this the result is subnormal: flushed to 0
_C = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                   4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))


@intrinsic
def _int_bits_as_f32(typingctx, bits):
    """The float32 whose IEEE bits are the int32 `bits` (a no-op cast LLVM can vectorize)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@kernel(inline="always", fastmath=SAFE_FASTMATH)
def _exp32(x):
    y = _LO if x < _LO else x  # NaN passes both clamps unchanged
    y = _HI if y > _HI else y
    n = np.floor(y * _LOG2E + np.float32(0.5))
    n = np.float32(127.0) if n > np.float32(127.0) else n  # 2**n stays a normal float32
    r = y - n * _LN2_HI - n * _LN2_LO  # |r| <= ln2 / 2 (up to 0.72 just below overflow)
    p = _C[0]
    p = p * r + _C[1]
    p = p * r + _C[2]
    p = p * r + _C[3]
    p = p * r + _C[4]
    p = p * r + _C[5]
    p = p * r * r + r + np.float32(1.0)
    out = p * _int_bits_as_f32((np.int32(n) + np.int32(127)) << 23)
    if x < _LO:
        out = np.float32(0.0)
    if x > _HI:
        out = np.float32(np.inf)
    return out


def fexp(x):
    """exp(x); in Numba code float32 takes the vectorizable path."""
    return math.exp(x)


@overload(fexp, inline="always")
def _fexp_overload(x):
    if isinstance(x, types.Float) and x.bitwidth == 32:
        return lambda x: _exp32(x)
    return lambda x: math.exp(x)


def one_like(x):
    """1 in x's float type, so float32 kernels do not widen to float64 on a literal."""
    return 1.0


@overload(one_like, inline="always")
def _one_like_overload(x):
    if isinstance(x, types.Float) and x.bitwidth == 32:
        return lambda x: np.float32(1.0)
    return lambda x: 1.0
