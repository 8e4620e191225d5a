"""Launching Numba-CUDA kernels on cupy arrays (or host arrays in the simulator), and the
argument list every packed-weight kernel takes."""
import numpy as np
from numba import cuda

from ...errors import QuantError
from ...quant.registry import FLAT
from ..format_ids import FORMAT_IDS, checked_format


def is_cupy(a):
    return type(a).__module__.split(".")[0] == "cupy"


def launch(kernel, grid, block, args, result):
    """kernel[grid, block](*args); args[result] is the output array (cupy or numpy)."""
    out = args[result]
    if is_cupy(out):
        import cupy
        # Launch on cupy's current stream; that orders us after the work that made the
        # inputs, so the interface import needs no extra synchronisation.
        stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)
        args = [cuda.as_cuda_array(v, sync=False) if is_cupy(v) else v for v in args]
        kernel[grid, block, stream](*args)
        return
    # numpy (simulator, or host arrays on a GPU): explicit copies, so read-only inputs are
    # never written back; only the result is copied to the host.
    args = [cuda.to_device(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
            for v in args]
    kernel[grid, block](*args)
    args[result].copy_to_host(out)


def weight_args(w, xp):
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
