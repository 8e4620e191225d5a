"""Numba CPU kernels."""
import functools

import numba
import numpy as np
from numba import njit, prange

# Elements below which a row kernel runs on the calling thread: a Numba parallel region costs
# ~0.1 ms with the workqueue layer on the 2-core machines measured, the time of ~10^5 elements
# (on the OpenMP layer a few microseconds: this bound is the workqueue's, kept for both).
SERIAL_MAX = 1 << 17


def kernel(**options):
    """numba.njit as every CPU kernel takes it: cached on disk, with numpy's error model.

    Numba's default model checks every division for zero, to raise ZeroDivisionError from
    inside the kernel. The check is a branch in the loop, and LLVM then leaves the loop scalar:
    SwiGLU's rows ran ~8x slower on the calling thread than vectorized (measured on 128k
    values). Numba compiles a parallel loop's body with numpy's model already, so with it here
    the serial and parallel paths of a kernel compute alike: a float division by zero gives inf
    or NaN, which the callers' finiteness checks report, and an integer one gives 0, so the
    callers (ops, never users) pass checked shapes.
    """
    return njit(cache=True, error_model="numpy", **options)


@kernel(parallel=True)
def _touch(a):
    for i in prange(a.size):
        a[i] = 0.0


@functools.cache
def cheap_regions():
    """Whether a Numba parallel region costs microseconds (the OpenMP or TBB layer src/_env.py
    asks for) rather than ~0.1 ms (workqueue: where OpenMP cannot load, or the user chose it)."""
    _touch(np.zeros(2))  # the layer is chosen at the first parallel launch
    return numba.threading_layer() != "workqueue"


def takes(xp, *arrays):
    """Whether the float32 Numba kernels apply: numpy arrays, all float32 (else callers use
    numpy/cupy expressions)."""
    return xp is np and all(a.dtype == np.float32 for a in arrays)
