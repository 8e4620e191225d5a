"""CUDA packed linear ops: y = x @ W.T and dx = dy @ W with W kept packed (fused dequant-GEMM)."""

import numpy as np
from numba import config, cuda

from ...errors import DeviceError, QuantError
from .decode import FP4, INT8, NF4, Q4_0, Q4_1, Q8_0
from .gemm import Tile, gemm_kernel

FORMAT_IDS = {"nf4": NF4, "fp4": FP4, "int8": INT8, "q4_0": Q4_0, "q4_1": Q4_1, "q8_0": Q8_0}
GGUF_BPB = {"q4_0": 18, "q4_1": 20, "q8_0": 34}

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
    if w.format not in FORMAT_IDS:
        raise QuantError(f"packed weight: unknown format {w.format!r}; "
                         f"expected one of {sorted(FORMAT_IDS)}")
    if len(w.shape) != 2:
        raise QuantError(f"packed weight ({w.format}): linear needs a 2-D (N, K) weight, "
                         f"got shape {tuple(w.shape)}")
    n, k = (int(s) for s in w.shape)
    if w.format in GGUF_BPB and k % 32:
        raise QuantError(f"packed weight ({w.format}): K={k} is not a multiple of 32")
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
    n, k = w.shape
    fmt = w.format
    f32, u8 = _placeholders(xp)
    if fmt in GGUF_BPB:
        q = _buffer(w, "blocks", (n, (k // 32) * GGUF_BPB[fmt]), np.uint8).reshape(-1)
        return [k, FORMAT_IDS[fmt], 32, 0, q, f32, u8, f32, f32, f32, f32]
    bs = int(w.block_size)
    nblocks = (n * k + bs - 1) // bs
    if fmt == "int8":
        q = _buffer(w, "codes", (n * k,), np.int8).view(np.uint8)
        absmax = _buffer(w, "absmax", (nblocks,), np.float32)
        return [k, INT8, bs, 0, q, absmax, u8, f32, f32, f32, f32]
    q = _buffer(w, "codes", ((n * k + 1) // 2,), np.uint8)
    cb = _codebook(fmt, xp)
    if not w.double_quant:
        absmax = _buffer(w, "absmax", (nblocks,), np.float32)
        return [k, FORMAT_IDS[fmt], bs, 0, q, absmax, u8, f32, f32, f32, cb]
    amq = _buffer(w, "absmax_q", (nblocks,), np.uint8)
    amcode = _buffer(w, "absmax_code", (256,), np.float32)
    amscale = _buffer(w, "absmax_scale", ((nblocks + 255) // 256,), np.float32)
    amoff = _buffer(w, "absmax_offset", (1,), np.float32)
    return [k, FORMAT_IDS[fmt], bs, 1, q, f32, amq, amcode, amscale, amoff, cb]


def _buffer(w, name, shape, dtype):
    """w.buffers[name], checked for shape and dtype against the layout contract."""
    if name not in w.buffers:
        raise QuantError(f"packed weight ({w.format}, shape {tuple(w.shape)}): "
                         f"missing buffer {name!r}")
    b = w.buffers[name]
    if tuple(b.shape) != shape or b.dtype != dtype:
        raise QuantError(f"packed weight ({w.format}, shape {tuple(w.shape)}): buffer {name!r} "
                         f"is {b.dtype} {tuple(b.shape)}, expected {np.dtype(dtype)} {shape}")
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


def _codebook(fmt, xp):
    """The 16-entry float32 codebook of nf4 / fp4 on xp's device."""
    key = (fmt, xp.__name__)
    if key not in _CODEBOOKS:
        from ...quant import FP4_CODE, NF4_CODE
        code = NF4_CODE if fmt == "nf4" else FP4_CODE
        _CODEBOOKS[key] = xp.asarray(np.asarray(code, dtype=np.float32))
    return _CODEBOOKS[key]
