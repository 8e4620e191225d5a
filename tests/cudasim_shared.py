"""Locks around two races of Numba's CUDA simulator (import only with NUMBA_ENABLE_CUDASIM=1):
its static shared arrays, and its swap of the `cuda` module for device functions.

Numba's simulator (numba 0.68's numba.cuda and numba-cuda 0.30.4 alike) runs a block's threads as
Python threads and hands out `cuda.shared.array` from a dict keyed by the line that asks for
it, checking and filling that dict without a lock. Two threads that reach the line together in
a launch's first block can each make an array of their own, so the block's threads no longer
share it and the kernel's result is wrong. A GPU has no such race.

Measured on the 9x1x96 kernel cases at a 10 µs thread switch interval, as wrong results (and
lines that got a second array): numba 0.68.1, 23 in 300 runs (24); numba-cuda 0.30.4, 4 in 120
(4). With this lock: 0 in 300 and 0 in 120.
"""
import contextlib
import sys
import threading

import numpy as np
from numba import cuda
from numba.core import types
from numba.cuda.simulator import kernel as sim_kernel
from numba.cuda.simulator import kernelapi
from numba.np import numpy_support

_LOCK = threading.Lock()
_UNLOCKED = kernelapi.FakeCUDAShared.array


def _locked_array(self, shape, dtype, *rest, **options):
    """FakeCUDAShared.array, one array per calling line, made under a lock."""
    if shape == 0 or rest or options:  # dynamic shared memory (one buffer), or alignment
        return _UNLOCKED(self, shape, dtype, *rest, **options)
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    caller = sys._getframe(1)
    line = (caller.f_code.co_filename, caller.f_lineno)  # the simulator's own key
    with _LOCK:
        array = self._allocations.get(line)
        if array is None:
            array = self._allocations[line] = np.empty(shape, dtype)
    return array


def lock_shared_arrays():
    """Make every simulated block's threads get the same array for each shared-array line."""
    kernelapi.FakeCUDAShared.array = _locked_array


# A device function's call swaps the fake `cuda` module into its module's globals and back on
# return. The block's threads call it at once: the first to return puts the real module back
# while the others still run in it, and they fail on an attribute only the fake has
# (cuda.threadfence). A kernel's own module is swapped for the whole launch, so only device
# functions of other modules that use `cuda.` meet this (parts.py's). Here a device function's
# module is swapped at its first call in a launch and put back when the launch ends; launches
# come one at a time.
_SWAP_LOCK = threading.Lock()
_SWAPPED = {}  # id(globals) -> (globals, the entries swapped out), during a launch


def _swap(globs, fake_cuda_module):
    orig = {k: v for k, v in globs.items() if v is cuda}
    globs.update(dict.fromkeys(orig, fake_cuda_module))
    _SWAPPED[id(globs)] = (globs, orig)


@contextlib.contextmanager
def _launch_long_swap(fn, fake_cuda_module):
    globs = fn.__globals__
    if _SWAPPED:  # a device function's call, inside a launch
        if id(globs) not in _SWAPPED:
            with _SWAP_LOCK:
                if id(globs) not in _SWAPPED:
                    _swap(globs, fake_cuda_module)
        yield
        return
    _swap(globs, fake_cuda_module)  # a launch
    try:
        yield
    finally:
        for g, orig in _SWAPPED.values():
            g.update(orig)
        _SWAPPED.clear()


def swap_modules_per_launch():
    """Make the simulator's swap of the `cuda` module safe for calls from many threads."""
    sim_kernel.swapped_cuda_module = _launch_long_swap
