"""The host side of packlora's GPU launches, without a GPU: what each launch passes to cuda.core,
and the host time of a packed product at small M through Numba's ordinary launch and through a
replayed one (kernels/cuda/prepared.py), as JSON.

Runs the real entry points (linear_fwd, linear_bwd, gather_rows) with Numba-CUDA compiling
every kernel (NVVM, as on a GPU), on stand-in cupy arrays (numpy memory behind cupy's
attributes) and with the driver's parts stubbed: loading the compiled module, the context, the
stream, and cuda.core's launch itself, which records its parameters instead. So:
  - "same_params": for each kernel, the replayed launch passes exactly what Numba's ordinary
    launch passes on the same arrays (kernel, grid, block, every parameter);
  - "*_host_us": the host time per product up to the driver call, taking turns, ordinary vs
    replayed. The driver call itself (cuda.core's launch, the same on both paths) is not in it.

Needs Numba-CUDA with libnvvm (CUDA_HOME), no driver, no device, no cupy:
  CUDA_HOME=/usr/local/cuda $CACHE/cuda-compile-venv/bin/python bench/cuda_launch_host.py
"""
import argparse
import json
import sys
import time
import types as pytypes

import numpy as np

# ---- stand-in cupy: installed before packlora imports it -------------------------------------
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

    def __setitem__(self, key, value):
        self._a[key] = value


def _stand_in(fn):
    return lambda *a, **k: ndarray(fn(*a, **k))


cupy.ndarray = ndarray
cupy.empty, cupy.zeros, cupy.arange = (_stand_in(f) for f in (np.empty, np.zeros, np.arange))
cupy.asarray = _stand_in(lambda a, dtype=None: np.ascontiguousarray(a, dtype=dtype))
cupy.cuda = pytypes.SimpleNamespace(
    runtime=pytypes.SimpleNamespace(getDevice=lambda: 0),
    get_current_stream=lambda: pytypes.SimpleNamespace(ptr=0x5EED))

import numba.cuda.api as cuda_api  # noqa: E402
import numba.cuda.codegen as cuda_codegen  # noqa: E402
import numba.cuda.dispatcher as cuda_dispatcher  # noqa: E402
from numba import cuda  # noqa: E402
from numba.cuda.cudadrv import driver  # noqa: E402

from kernels import random_packed  # noqa: E402  (bench/kernels.py)
from packlora.kernels.cuda import launch, ops, prepared, rows  # noqa: E402
from packlora.quant.packed import PackedWeight  # noqa: E402

FORMATS = ("nf4+dq", "q4_k", "q8_0")
CASES = (("gemv", 1), ("tile", 16))  # (kernel a product of M rows takes, M)


class _Target:
    def __init__(self, cc):
        self.compute_capability = cc


class _Function:
    """A loaded kernel as Numba's launch reads it."""
    def __init__(self, name):
        self.kernel = ("function", name)
        self.name = name


class _Recorder:
    """cuda.core's launch: records (function, grid, block, parameters), and counts the
    launches that came from a replay (prepared.py) rather than from Numba."""
    def __init__(self):
        self.calls = []
        self.replays = 0
        self.keep = True  # off while timing: the recording would weigh on both paths

    def __call__(self, stream, config, function, *params):
        if self.keep:
            self.calls.append((function, config, _plain(params)))

    def replay(self, *launch):
        self.replays += 1
        self(*launch)


def _plain(params):
    return [(type(p).__name__, p.value) if hasattr(p, "value") else int(p) for p in params]


class _Config:
    def __init__(self, grid, block, **_options):
        self.grid, self.block = _dim3(grid), _dim3(block)

    def __eq__(self, other):
        return (self.grid, self.block) == (other.grid, other.block)


def _dim3(d):
    d = (d,) if isinstance(d, int) else tuple(d)
    return d + (1,) * (3 - len(d))


def _stub_driver(cc):
    """Compile for cc without a device; record launches instead of making them."""
    recorder = _Recorder()
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


def _on_stand_in(w):
    return PackedWeight(w.format, w.shape, {k: cupy.asarray(b) for k, b in w.buffers.items()},
                        w.block_size, w.double_quant)


def _products(w, m, kernel, rng):
    """{name: call} for one weight at M rows: forward, backward (and the row gather), each
    into an output of its own (the same arrays on both paths)."""
    n, k = w.shape
    x = cupy.asarray(rng.standard_normal((m, k), dtype=np.float32))    # (M, K)
    dy = cupy.asarray(rng.standard_normal((m, n), dtype=np.float32))   # (M, N)
    y, dx = cupy.empty((m, n), np.float32), cupy.empty((m, k), np.float32)
    tile = None if kernel == "gemv" else ops.SMALL_M_TILE
    calls = {"fwd": lambda: ops.linear_fwd(x, w, y, tile=tile),
             "bwd": lambda: ops.linear_bwd(dy, w, dx, tile=tile)}
    if kernel == "gemv":
        picked, out = cupy.arange(0, m, dtype=np.int64), cupy.empty((m, k), np.float32)
        calls["gather"] = lambda: rows.gather_rows(w, picked, out)
    return calls


def _launches(recorder, call, replayed):
    """What one call passed to cuda.core, ordinary or replayed launches."""
    launch.PREPARED_LAUNCHES = replayed
    start = len(recorder.calls)
    call()
    return recorder.calls[start:]


def _host_us(recorder, call, replayed, reps):
    launch.PREPARED_LAUNCHES = replayed
    recorder.keep = False
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    elapsed = time.perf_counter() - t0
    recorder.keep = True
    return elapsed / reps * 1e6


def bench(recorder, fmt, n, k, rounds, reps, rng):
    w = _on_stand_in(random_packed(fmt, n, k, rng))
    rows_out = []
    for kernel, m in CASES:
        for op, call in _products(w, m, kernel, rng).items():
            ordinary = _launches(recorder, call, False)
            _launches(recorder, call, True)       # the first: ordinary, then prepared
            before = recorder.replays
            replayed = _launches(recorder, call, True)
            replays = recorder.replays - before
            times = {True: [], False: []}
            for _ in range(rounds):                # taking turns
                for side in (False, True):
                    times[side].append(_host_us(recorder, call, side, reps))
            ordinary_us, replayed_us = (float(np.median(times[s])) for s in (False, True))
            rows_out.append({"format": fmt, "N": n, "K": k, "M": m, "kernel": kernel,
                             "op": op, "launches": len(replayed), "replays": replays,
                             "same_params": ordinary == replayed and len(ordinary) > 0,
                             "ordinary_host_us": round(ordinary_us, 1),
                             "replayed_host_us": round(replayed_us, 1),
                             "ratio": round(replayed_us / ordinary_us, 3)})
            print(json.dumps(rows_out[-1]), file=sys.stderr, flush=True)
    return rows_out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default="9.0")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shape", default="4096,4096", help="N,K of the weight")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    recorder = _stub_driver(tuple(int(p) for p in args.cc.split(".")))
    n, k = (int(v) for v in args.shape.split(","))
    rng = np.random.default_rng(0)
    results = [row for fmt in args.formats.split(",")
               for row in bench(recorder, fmt, n, k, args.rounds, args.reps, rng)]
    print(json.dumps({"cc": args.cc, "note": "host time up to cuda.core's launch (stubbed)",
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
