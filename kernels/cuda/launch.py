"""Launching Numba-CUDA kernels on cupy arrays (or host arrays in the simulator), and the
argument list every packed-weight kernel takes.

Every packed-weight kernel is built once per format (`build(fmt, dq)`, cached by its module):
the format id and double quantization are constants of the compiled code, so it carries one
format's decoder, not all of them (what that saves in registers and code: bench/cuda_static.py).

At small M a launch's host cost exceeds its kernel's time on a GPU (0.4-0.8 ms per call on an
H200, against 0.04-0.2 ms for cuBLAS): wrapping each cupy array for Numba makes a device array,
a memory pointer and a stream object, and Numba types and marshals every argument. So a
weight's kernel arguments are made once and kept with it (`weight_args`, rebuilt only when one
of its buffers is replaced), the stream handles of cupy's current stream are made once, an
array's wrapper skips the stream of its interface (the launch names the stream itself), and
after a first ordinary launch per kernel and argument types, launches are replayed without
Numba's per-call work (prepared.py; bench/cuda_launch_host.py measures the host side)."""
import contextlib
import warnings
import weakref

import numpy as np
from numba import cuda

from ...errors import DeviceError, QuantError
from ...quant.packed import array_module
from ...quant.registry import FLAT
from ..format_ids import FORMAT_IDS, checked_format
from . import prepared

try:  # without cupy only host arrays are launched (the simulator)
    import cupy
except ImportError:
    cupy = None


# Off: every GPU launch takes Numba's ordinary path (bench/kernels_cuda.py times both).
PREPARED_LAUNCHES = True
# Blocks a grid may have along x, and along y or z (CUDA's limits; the simulator has none).
MAX_GRID_X, MAX_GRID_YZ = 2**31 - 1, 65535


def is_cupy(a):
    return cupy is not None and isinstance(a, cupy.ndarray)


def launch(build, grid, block, args, w, result=1):
    """build(fmt, dq)[grid, block](*args, *weight_args(w)) with w's format id and double
    quantization; args[result] is the output array (cupy or numpy)."""
    check_grid(grid)
    out = args[result]
    kept = _kept(w, array_module(out))
    kernel, wargs = build(*kept.spec), kept.args
    if is_cupy(out):
        _launch_gpu(kernel, grid, block, args, kept)
        return
    _launch_host(kernel, grid, block, [*args, *wargs], result)


def launch_plain(kernel, grid, block, args, result=1):
    """kernel[grid, block](*args) for a kernel that takes no packed weight, on cupy's current
    stream (or on host arrays in the simulator); args[result] is the output array."""
    check_grid(grid)
    if is_cupy(args[result]):
        with _grids_are_ours():
            kernel[grid, block, _stream()[0]](*_views(args))
        return
    _launch_host(kernel, grid, block, args, result)


def _launch_host(kernel, grid, block, args, result):
    """numpy arrays (simulator, or host arrays on a GPU): explicit copies, so read-only inputs
    are never written back; only args[result] is copied to the host."""
    out = args[result]
    args = [cuda.to_device(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
            for v in args]
    with _grids_are_ours():
        kernel[grid, block](*args)
    args[result].copy_to_host(out)


def zero(c):
    """c[...] = 0 for a C-contiguous output: on a GPU one cudaMemsetAsync on cupy's current
    stream (where the kernel that adds into c then runs), not a cupy fill kernel's launch."""
    if is_cupy(c):
        cupy.cuda.runtime.memsetAsync(c.data.ptr, 0, c.nbytes,
                                      cupy.cuda.get_current_stream().ptr)
    else:
        c[...] = 0


def check_grid(grid):
    """Refuse a grid past CUDA's limits here, in words, not as the driver's invalid value."""
    g = grid if type(grid) is tuple else (grid,)
    if g[0] > MAX_GRID_X or (len(g) > 1 and max(g[1:]) > MAX_GRID_YZ):
        raise DeviceError(f"a kernel launch asks for a grid of {g} blocks; CUDA allows at most "
                          f"{MAX_GRID_X} along x and {MAX_GRID_YZ} along y and z")


def _launch_gpu(kernel, grid, block, args, kept):
    """kernel[grid, block](*args, *kept.args) on cupy's current stream: replayed (prepared.py)
    after a first ordinary launch for these argument types, unless PREPARED_LAUNCHES is off."""
    numba_stream, core_stream = _stream()
    if PREPARED_LAUNCHES:
        key = (kernel, prepared.signature(args))
        replay = kept.prepared.get(key)
        if replay is not None:
            replay(core_stream, grid, block, args)
            return
        if key not in kept.prepared:
            if all(isinstance(v, int) or is_cupy(v) for v in args):
                with _grids_are_ours():
                    kept.prepared[key] = prepared.first_launch(kernel, grid, block, numba_stream,
                                                               args, _views(args), kept.args)
                return
            kept.prepared[key] = None  # host arrays among them: Numba copies them each launch
    with _grids_are_ours():
        kernel[grid, block, numba_stream](*_views(args), *kept.args)


@contextlib.contextmanager
def _grids_are_ours():
    """Numba's launch without its warning for grids under 128 blocks: packlora sizes each grid
    to its product (a small weight's GEMV or one looked-up row is a small grid by nature), and
    the warning would only puzzle its users."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Grid size .* under-utilization")
        yield


def _views(args):
    return [_device_view(v) if is_cupy(v) else v for v in args]


class _WeightArgs:
    """A weight's kernel arguments on one backend, what they were made from, and the (format
    id, double quantization) its kernels are built for."""

    def __init__(self, key, spec, args):
        self.key = key
        self.spec = spec
        self.args = args
        self.prepared = {}  # (kernel, argument signature) -> prepared.Prepared or None


_WEIGHT_ARGS = weakref.WeakKeyDictionary()   # PackedWeight -> _WeightArgs


def weight_args(w, xp):
    """Kernel args after (a, c, ...): kdim, bs, q, q16, absmax, amq, amcode, amscale, amoff,
    codebook; on a GPU as Numba device views. q16 is q's float16 view (block formats, whose
    fp16 scales sit at even offsets). Unused slots get tiny placeholder arrays."""
    return _kept(w, xp).args


def _kept(w, xp):
    """w's _WeightArgs on backend xp: made once per weight and backend; a replaced buffer makes
    them again (the kept views hold the buffers they were made from, so their ids cannot be
    reused meanwhile)."""
    key = (_where(xp), tuple((name, id(b)) for name, b in w.buffers.items()))
    kept = _WEIGHT_ARGS.get(w)
    if kept is None or kept.key != key:
        entry = checked_format(w)  # the buffers' names, dtypes and shapes
        dq = 1 if entry.storage == FLAT and w.double_quant else 0
        args = _weight_args(w, entry, dq, xp)
        if xp is cupy:
            args = [_device_view(a) if is_cupy(a) else a for a in args]
        kept = _WEIGHT_ARGS[w] = _WeightArgs(key, (FORMAT_IDS[entry.name], dq), args)
    return kept


def _weight_args(w, entry, dq, xp):
    k = int(w.shape[1])
    f32, u8, f16 = _placeholders(xp)
    if entry.storage != FLAT:
        q = _contiguous(w, "blocks").reshape(-1)  # even bytes a block (decode_k asserts)
        return [k, entry.layout.elems, q, q.view(np.float16), f32, u8, f32, f32, f32, f32]
    bs = int(w.block_size)
    q = _contiguous(w, "codes").view(np.uint8)
    cb = f32 if entry.codebook is None else _codebook(entry, xp)
    if not dq:
        return [k, bs, q, f16, _contiguous(w, "absmax"), u8, f32, f32, f32, cb]
    amq, amcode, amscale, amoff = (_contiguous(w, name) for name in (
        "absmax_q", "absmax_code", "absmax_scale", "absmax_offset"))
    return [k, bs, q, f16, f32, amq, amcode, amscale, amoff, cb]


def _device_view(a):
    """A Numba device array over cupy array a's memory (kept alive by the view), without the
    stream object its interface would make: launches name the stream."""
    desc = dict(a.__cuda_array_interface__)
    desc.pop("stream", None)
    return cuda.from_cuda_array_interface(desc, owner=a, sync=False)


def _where(xp):
    """The backend and, on a GPU, the current device: what the kept arrays and streams are
    specific to."""
    return (xp.__name__, cupy.cuda.runtime.getDevice() if xp is cupy else None)


def _stream_key(xp):
    """The backend, device and (on a GPU) cupy's current stream: what launch state is kept per."""
    return (_where(xp), cupy.cuda.get_current_stream().ptr if xp is cupy else None)


_STREAMS = {}


def _stream():
    """Numba's and cuda.core's handles on cupy's current stream: launching there orders the
    kernel after the work that made its inputs, so the interface import needs no extra
    synchronisation."""
    key = _stream_key(cupy)
    if key not in _STREAMS:
        numba_stream = cuda.external_stream(key[1])
        _STREAMS[key] = (numba_stream, prepared.core_stream(numba_stream))
    return _STREAMS[key]


def _contiguous(w, name):
    """w.buffers[name] (checked against the registry's layout by checked_format)."""
    b = w.buffers[name]
    if not b.flags.c_contiguous:
        raise QuantError(f"packed weight ({w.format}): buffer {name!r} is not contiguous")
    return b


_PLACEHOLDERS = {}
_CODEBOOKS = {}
_COUNTERS = {}


def counters(xp, n):
    """At least n int32 counters on xp's device and cupy's current stream, zero between
    launches (parts.py): made once and kept, larger when a launch needs more (the old ones are
    freed in stream order). Launches on two streams at once would count on each other's."""
    key = _stream_key(xp)
    have = _COUNTERS.get(key)
    if have is None or have.size < n:
        have = _COUNTERS[key] = xp.zeros(max(n, 1024, 0 if have is None else 2 * have.size),
                                         dtype=np.int32)
    return have


def _placeholders(xp):
    """One-element float32, uint8 and float16 arrays on xp's device, for kernel slots a format
    ignores."""
    key = _where(xp)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = tuple(xp.zeros(1, dtype=t) for t in (np.float32, np.uint8,
                                                                  np.float16))
    return _PLACEHOLDERS[key]


def _codebook(entry, xp):
    """The 16-entry float32 codebook of a table format (nf4 / fp4) on xp's device."""
    key = (entry.name, _where(xp))
    if key not in _CODEBOOKS:
        _CODEBOOKS[key] = xp.asarray(np.asarray(entry.codebook, dtype=np.float32))
    return _CODEBOOKS[key]
