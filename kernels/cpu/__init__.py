"""Numba CPU kernels."""
import numpy as np

# Elements below which a row kernel runs on the calling thread: a Numba parallel region costs
# ~0.1 ms with the workqueue layer on the 2-core machines measured, the time of ~10^5 elements.
SERIAL_MAX = 1 << 17


def takes(xp, *arrays):
    """Whether the float32 Numba kernels apply: numpy arrays, all float32 (else callers use
    numpy/cupy expressions)."""
    return xp is np and all(a.dtype == np.float32 for a in arrays)
