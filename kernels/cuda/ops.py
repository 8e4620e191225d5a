"""CUDA packed linear ops: y = x @ W.T and dx = dy @ W with W kept packed (fused dequant-GEMM)."""

import numpy as np
from numba import config, cuda

from ...errors import DeviceError, QuantError
from ...quant.registry import FLAT
from ..format_ids import FORMAT_IDS, checked_format
from .gemm import Tile, gemm_kernel

SIM_TILE = Tile(tm=8, tc=16, tr=16, rm=4, rn=4, seg=8)  # 8 threads: fast in the simulator
SMALL_M_TILE = Tile(tm=16, tc=64, tr=32, rm=1, rn=4, seg=8)  # 256 threads, M <= 16
LARGE_M_TILE = Tile(tm=64, tc=64, tr=16, rm=4, rn=4, seg=4)  # 256 threads


def linear_fwd(x, w, out=None, *, tile=None):
    """y (M, N) = x (M, K) @ W.T for a PackedWeight w of logical shape (N, K)."""
    n, k = _weight_shape(w)
    _check_input(x, k, "x", "linear_fwd", f"in_features K={k}")
    y = _output(x, out, (x.shape[0], n), "linear_fwd")
    _launch(x, y, w, bwd=0, tile=tile)
    return y


def linear_bwd(dy, w, out=None, *, tile=None):
    """dx (M, K) = dy (M, N) @ W for a PackedWeight w of logical shape (N, K)."""
    n, k = _weight_shape(w)
    _check_input(dy, n, "dy", "linear_bwd", f"out_features N={n}")
    dx = _output(dy, out, (dy.shape[0], k), "linear_bwd")
    _launch(dy, dx, w, bwd=1, tile=tile)
    return dx


def _weight_shape(w):
    checked_format(w)  # known format, 2-D, buffers as the registry lays them out
    n, k = (int(s) for s in w.shape)
    return n, k


def _check_input(a, width, name, op, what):
    if a.ndim != 2 or a.shape[1] != width:
        raise ValueError(f"{op}: {name} must be (M, {width}) to match the weight's {what}, "
                         f"got shape {tuple(a.shape)}")
    if a.dtype != np.float32:
        raise ValueError(f"{op}: {name} must be float32, got {a.dtype}")


def _output(a, out, shape, op):
    """The result array: `out` if given (checked), else new from a's array module."""
    if out is None:
        return _array_module(a).empty(shape, dtype=np.float32)
    if tuple(out.shape) != shape or out.dtype != np.float32:
        raise ValueError(f"{op}: out must be float32 {shape}, got {out.dtype} {tuple(out.shape)}")
    if _is_cupy(out) != _is_cupy(a) or not out.flags.c_contiguous:
        raise ValueError(f"{op}: out must be a C-contiguous array of the same array module as "
                         f"the input ({type(a).__module__})")
    return out


def _is_cupy(a):
    return type(a).__module__.split(".")[0] == "cupy"


def _array_module(a):
    if _is_cupy(a):
        import cupy
        return cupy
    return np


def _default_tile(m):
    if config.ENABLE_CUDASIM:
        return SIM_TILE
    return SMALL_M_TILE if m <= 16 else LARGE_M_TILE


def _launch(a, c, w, bwd, tile):
    """Launch the packed GEMM kernel for c = a @ (W.T if fwd else W)."""
    if _is_cupy(next(iter(w.buffers.values()))) != _is_cupy(a):
        where = "GPU (cupy)" if _is_cupy(a) else "host (numpy)"
        raise DeviceError(f"packed weight ({w.format}, shape {tuple(w.shape)}) is not on the "
                          f"input's device {where}; move it with w.to_device(dev)")
    m, cdim = c.shape
    if m == 0 or cdim == 0:
        return
    if a.shape[1] == 0:
        c[...] = 0
        return
    tile = tile or _default_tile(m)
    grid = ((cdim + tile.tc - 1) // tile.tc, (m + tile.tm - 1) // tile.tm)
    launch(gemm_kernel(tile), grid, tile.block, [a, c, bwd] + _weight_args(w, _array_module(a)),
           result=1)


def launch(kernel, grid, block, args, result):
    """kernel[grid, block](*args); args[result] is the output array (cupy or numpy)."""
    out = args[result]
    if _is_cupy(out):
        import cupy
        # Launch on cupy's current stream; that orders us after the work that made the
        # inputs, so the interface import needs no extra synchronisation.
        stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)
        args = [cuda.as_cuda_array(v, sync=False) if _is_cupy(v) else v for v in args]
        kernel[grid, block, stream](*args)
        return
    # numpy (simulator, or host arrays on a GPU): explicit copies, so read-only inputs are
    # never written back; only the result is copied to the host.
    args = [cuda.to_device(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
            for v in args]
    kernel[grid, block](*args)
    args[result].copy_to_host(out)


def _weight_args(w, xp):
    """Kernel args after (a, c, bwd): kdim, fmt, bs, dq, q, absmax, amq, amcode, amscale,
    amoff, codebook. Unused slots get tiny placeholder arrays."""
    entry = checked_format(w)  # the buffers' names, dtypes and shapes
    k = int(w.shape[1])
    fid = FORMAT_IDS[entry.name]
    f32, u8 = _placeholders(xp)
    if entry.storage != FLAT:
        q = _contiguous(w, "blocks").reshape(-1)
        return [k, fid, entry.layout.elems, 0, q, f32, u8, f32, f32, f32, f32]
    bs = int(w.block_size)
    q = _contiguous(w, "codes").view(np.uint8)
    cb = f32 if entry.codebook is None else _codebook(entry, xp)
    if not w.double_quant:
        return [k, fid, bs, 0, q, _contiguous(w, "absmax"), u8, f32, f32, f32, cb]
    amq, amcode, amscale, amoff = (_contiguous(w, name) for name in (
        "absmax_q", "absmax_code", "absmax_scale", "absmax_offset"))
    return [k, fid, bs, 1, q, f32, amq, amcode, amscale, amoff, cb]


def _contiguous(w, name):
    """w.buffers[name] (checked against the registry's layout by checked_format)."""
    b = w.buffers[name]
    if not b.flags.c_contiguous:
        raise QuantError(f"packed weight ({w.format}): buffer {name!r} is not contiguous")
    return b


_PLACEHOLDERS = {}
_CODEBOOKS = {}


def _placeholders(xp):
    """One-element float32 and uint8 arrays on xp's device, for kernel slots a format ignores."""
    key = xp.__name__
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = (xp.zeros(1, dtype=np.float32), xp.zeros(1, dtype=np.uint8))
    return _PLACEHOLDERS[key]


def _codebook(entry, xp):
    """The 16-entry float32 codebook of a table format (nf4 / fp4) on xp's device."""
    key = (entry.name, xp.__name__)
    if key not in _CODEBOOKS:
        _CODEBOOKS[key] = xp.asarray(np.asarray(entry.codebook, dtype=np.float32))
    return _CODEBOOKS[key]
