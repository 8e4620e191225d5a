"""Numba CPU kernels."""
import numpy as np


def takes(xp, *arrays):
    """Whether the float32 Numba kernels apply: numpy arrays, all float32 (else callers use
    numpy/cupy expressions)."""
    return xp is np and all(a.dtype == np.float32 for a in arrays)
