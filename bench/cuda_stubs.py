"""A GPU-free stand-in for cupy and for the CUDA driver under Numba-CUDA: the host side of
packlora's GPU launches then runs, unchanged, on a machine without a GPU (bench/
cuda_launch_host.py; tests/test_cuda_static.py).

Importing this module installs the stand-in cupy (numpy memory behind the attributes of a cupy
array that the launch path reads), so import it before packlora. `stub_driver(cc)` then lets
Numba-CUDA compile for cc with NVVM as on a GPU, and stubs what needs a driver: the device,
loading the compiled module, the context, streams, and cuda.core's launch, which a `Recorder`
takes instead: each launch's stream, grid, block, options and parameters."""
import sys
import types as pytypes

import numpy as np

cupy = pytypes.ModuleType("cupy")
sys.modules["cupy"] = cupy


class _Pointer:
    def __init__(self, ptr):
        self.ptr = ptr


class ndarray:  # noqa: N801  (cupy's name)
    """The attributes of a cupy array the launch path reads, over a numpy array."""
    __module__ = "cupy"

    def __init__(self, a):
        self._a = a
        self.shape, self.dtype, self.ndim, self.size = a.shape, a.dtype, a.ndim, a.size
        self.itemsize, self.nbytes, self.strides, self.flags = (a.itemsize, a.nbytes,
                                                                a.strides, a.flags)
        self.data = _Pointer(a.ctypes.data)

    @property
    def __cuda_array_interface__(self):  # as cupy's: strides left out when C-contiguous
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (self.data.ptr, False),
                "strides": None if self.flags.c_contiguous else self.strides}

    def view(self, dtype):
        return ndarray(self._a.view(dtype))

    def reshape(self, *shape):
        return ndarray(self._a.reshape(*shape))

    def __getitem__(self, key):
        return ndarray(self._a[key])

    def __setitem__(self, key, value):
        self._a[key] = value


def _stand_in(fn):
    return lambda *a, **k: ndarray(fn(*a, **k))


cupy.ndarray = ndarray
cupy.empty, cupy.zeros, cupy.arange = (_stand_in(f) for f in (np.empty, np.zeros, np.arange))
cupy.asarray = _stand_in(lambda a, dtype=None: np.ascontiguousarray(a, dtype=dtype))
# the sum of a split reduction's parts: a cupy kernel's launch, whose host time is cupy's (not
# counted here); its output is never read
cupy.sum = lambda a, axis=None, out=None: out
cupy.cuda = pytypes.SimpleNamespace(
    # a driver call, as the launch is: not host work of packlora's (outputs are never read)
    runtime=pytypes.SimpleNamespace(getDevice=lambda: 0,
                                    memsetAsync=lambda ptr, value, size, stream: None),
    get_current_stream=lambda: pytypes.SimpleNamespace(ptr=0x5EED))

import numba.cuda.api as cuda_api  # noqa: E402
import numba.cuda.codegen as cuda_codegen  # noqa: E402
import numba.cuda.dispatcher as cuda_dispatcher  # noqa: E402
from numba import cuda  # noqa: E402
from numba.cuda.cudadrv import driver  # noqa: E402

from packlora.kernels.cuda import prepared  # noqa: E402
from packlora.quant.packed import PackedWeight  # noqa: E402


class Recorder:
    """cuda.core's launch: records (stream, config, function, parameters) and counts the
    launches that came from a replay (prepared.py) rather than from Numba."""

    def __init__(self):
        self.calls = []
        self.replays = 0
        self.keep = True  # off while timing: recording would weigh on both paths

    def __call__(self, stream, config, function, *params):
        if self.keep:
            self.calls.append((stream, config, function, _plain(params)))

    def replay(self, *launch):
        self.replays += 1
        self(*launch)


def _plain(params):
    return [(type(p).__name__, p.value) if hasattr(p, "value") else int(p) for p in params]


class _Config:
    """cuda.core's LaunchConfig: what a launch is configured with, in one comparable tuple."""

    def __init__(self, grid, block, shmem_size=0, cooperative_launch=False,
                 is_cooperative=False):
        self.key = (_dim3(grid), _dim3(block), shmem_size,
                    bool(cooperative_launch or is_cooperative))

    def __eq__(self, other):
        return self.key == other.key


def _dim3(d):
    d = (d,) if isinstance(d, int) else tuple(d)
    return d + (1,) * (3 - len(d))


class _Target:
    def __init__(self, cc):
        self.compute_capability = cc


class _Function:
    """A loaded kernel as Numba's launch reads it."""

    def __init__(self, name):
        self.kernel = ("function", name)
        self.name = name


def stub_driver(cc):
    """Compile for cc without a device; record launches instead of making them."""
    recorder = Recorder()
    cuda_dispatcher.get_current_device = lambda: _Target(cc)
    cuda_dispatcher.CUDADispatcher.enable_caching = lambda self: None  # no cubin to cache
    cuda_dispatcher._Kernel.bind = lambda self: None
    cuda_codegen.CUDACodeLibrary.get_cufunc = lambda self: _Function(self._entry_name)
    cuda_codegen.CUDACodeLibrary._ensure_cc = lambda self, want: want or cc
    cuda_api.current_context = lambda: None
    cuda.from_cuda_array_interface = cuda_api.from_cuda_array_interface.__wrapped__  # no context
    cuda.external_stream = lambda ptr: ("stream", ptr)
    driver._to_core_stream = prepared._to_core_stream = lambda s: ("core", s)
    cuda_dispatcher.launch, prepared.core_launch = recorder, recorder.replay
    cuda_dispatcher.LaunchConfig = prepared.LaunchConfig = _Config
    return recorder


def on_stand_in(w):
    """Host packed weight w with its buffers as stand-in cupy arrays."""
    return PackedWeight(w.format, w.shape, {k: cupy.asarray(b) for k, b in w.buffers.items()},
                        w.block_size, w.double_quant)
