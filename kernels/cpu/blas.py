"""sgemm with beta: C = A @ B + beta * C on strided float32 views, through the BLAS numpy uses.

numpy's matmul cannot accumulate into its output, so a product split along its reduction needs
a temporary and an extra pass. Calling the CBLAS sgemm numpy is linked with (its bundled
OpenBLAS, or the system's) accumulates in place. Without one, `gemm` falls back to numpy with a
temporary.
"""
import ctypes
import ctypes.util
import glob
import os

import numpy as np

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


def _candidates():
    """(library path, symbol, 64-bit integers) to try, numpy's own BLAS first."""
    root = os.path.dirname(os.path.dirname(np.__file__))
    for pattern in ("numpy.libs/*openblas*", "numpy/.dylibs/*openblas*", "numpy.libs/*.dll"):
        for path in sorted(glob.glob(os.path.join(root, pattern))):
            yield path, "scipy_cblas_sgemm64_", True
            yield path, "cblas_sgemm64_", True
            yield path, "cblas_sgemm", False
    for name in ("openblas", "Accelerate", "cblas"):
        path = ctypes.util.find_library(name)
        if path:
            yield path, "cblas_sgemm", False


def _load():
    """(sgemm, its library), or (None, None)."""
    for path, symbol, wide in _candidates():
        try:
            lib = ctypes.CDLL(path)
            fn = getattr(lib, symbol)
        except (OSError, AttributeError):
            continue
        it = ctypes.c_int64 if wide else ctypes.c_int
        ci, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        fn.argtypes = [ci, ci, ci, it, it, it, f, p, it, p, it, f, p, it]
        fn.restype = None
        return fn, lib
    return None, None


SGEMM, _LIB = _load()

# OpenBLAS's sgemm reduction block (SGEMM_DEFAULT_Q in its param.h, x86-64) for the cores its
# runtime dispatch picks: a product split along its reduction runs fastest in chunks that are a
# multiple of it (a 512-long chunk with a 448 block runs as two passes of 256 over the output).
_GEMM_Q = {"skylakex": 448, "cooperlake": 320, "sapphirerapids": 320, "haswell": 320,
           "zen": 320}


def _reduction_block():
    """The reduction block of numpy's OpenBLAS on this machine, or None when unknown."""
    for symbol in ("scipy_openblas_get_corename64_", "openblas_get_corename64_",
                   "openblas_get_corename"):
        fn = getattr(_LIB, symbol, None) if _LIB is not None else None
        if fn is not None:
            fn.restype = ctypes.c_char_p
            return _GEMM_Q.get((fn() or b"").decode().lower())
    return None


REDUCTION_BLOCK = _reduction_block()


def _operand(a):
    """(transpose flag, leading dimension) of a 2-D float32 view with one unit stride."""
    s0, s1 = (s // 4 for s in a.strides)
    if s1 == 1 or a.shape[1] == 1:
        return _NO_TRANS, max(s0, a.shape[1], 1)
    if s0 == 1 or a.shape[0] == 1:
        return _TRANS, max(s1, a.shape[0], 1)
    return None, None


def gemm(a, b, c, beta):
    """c (M, N) = a (M, K) @ b (K, N) + beta * c, beta 0 or 1; float32 views, each with a unit
    stride along one axis (c along its rows)."""
    ta, lda = _operand(a)
    tb, ldb = _operand(b)
    ok = (SGEMM is not None and ta is not None and tb is not None and c.strides[1] == 4
          and all(x.dtype == np.float32 for x in (a, b, c)))
    if not ok:
        if beta:
            c += a @ b
        else:
            np.matmul(a, b, out=c)
        return c
    m, k = a.shape
    n = b.shape[1]
    if m and n:
        SGEMM(_ROW_MAJOR, ta, tb, m, n, k, 1.0, a.ctypes.data, lda, b.ctypes.data, ldb,
              float(beta), c.ctypes.data, max(c.strides[0] // 4, n, 1))
    return c
