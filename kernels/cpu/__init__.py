"""Numba CPU kernels."""
import functools

import numba
import numpy as np
from numba import njit, prange

# Elements below which a row kernel runs on the calling thread: a Numba parallel region costs
# ~0.1 ms with the workqueue layer on the 2-core machines measured, the time of ~10^5 elements
# (on the OpenMP layer a few microseconds: this bound is the workqueue's, kept for both).
SERIAL_MAX = 1 << 17


@njit(parallel=True, cache=True)
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
