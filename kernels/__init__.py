"""The one entry point to packlora's kernels: matmuls with packed quantized weights (y = x @ W.T
and dx = dy @ W, W never expanded), the fused row kernels, and the facts the memory planner needs
about how they tile. Each call picks the CPU (Numba) or CUDA (Numba-CUDA) kernel from the arrays
it is given; nothing above this module names a backend."""
import numpy as np

from ..device import DEFAULT_SCRATCH_CAP
from ..errors import QuantError
from ..quant import quantize as reference_quantize
from ..quant.iquant_encode import encoders as iquant_encoders
from ..quant.kquant_encode import encoders as kquant_encoders
from .activations import int8_activations, int8_allowed
from .cpu import adamw8 as cpu_adamw8
from .cpu import blas
from .cpu import iq4_search, kquant_search
from .cpu import ops as cpu_ops
from .cpu import takes
from .cpu.ops import FUSED_MAX_M, FUSED_MAX_M_BWD
from .cpu.tiled import column_align
from .cpu.tiled import plan as tile_plan
from .cuda import ops as cuda_ops
from .cuda import rows as cuda_rows
from .cuda import scatter as cuda_scatter
from .cuda import tiled as cuda_tiled
from .format_ids import wrong_device
from .fused_rows import (
    ce_backward_,
    ce_forward,
    dscores_t_,
    one_query_attention,
    probs_t_,
    query_positions,
    rmsnorm_bwd,
    rmsnorm_fwd,
    rope_rotate,
    softmax_,
    swiglu_bwd,
    swiglu_fwd,
)

# Whether the CPU products accumulate into their output in place (CBLAS sgemm with beta = 1);
# without it add_product goes through the device's scratch.
CPU_GEMM_ACCUMULATES = blas.SGEMM is not None
# Rows up to which a GPU product runs the fused kernels (reductions split into parts), not
# decoded tiles and cuBLAS.
CUDA_FUSED_MAX_M = cuda_ops.FUSED_MAX_M
# Rows of a product up to which add_product adds a temporary rather than accumulate in place.
FEW_ROWS = 16
# The K-quant and IQ4 encoders with their per-sub-block searches compiled
_ENCODERS = {**kquant_encoders(kquant_search.SEARCHES), **iquant_encoders(iq4_search.fit_scales)}
COMPILED_QUANTIZERS = tuple(_ENCODERS)   # the formats kernels.quantize runs compiled code for


class _ModuleScratch:
    """The reused dense scratch used when no Device is given (capped like a Device's)."""

    def __init__(self):
        self.cap = DEFAULT_SCRATCH_CAP
        self.buf = None

    def get(self, nelem):
        if self.buf is None or self.buf.size < nelem:
            self.buf = np.empty(max(nelem, 1), np.float32)
        return self.buf[:nelem]


_SCRATCH = _ModuleScratch()


def quantize(array, format, block_size=None, double_quant=False, name=None):
    """quant.quantize with the K-quants' and IQ4's searches compiled (one sub-block per thread,
    summed in ggml's order): the reference's bytes but for near ties between candidates."""
    return reference_quantize(array, format, block_size, double_quant, name, _ENCODERS)


def _is_cuda(w):
    return w.xp is not np


def _scratch_of(device):
    """(scratch getter, cap in float32 elements) from a Device or the module fallback."""
    if device is None:
        return _SCRATCH.get, _SCRATCH.cap // 4
    return (lambda nelem: device.scratch(nelem, np.float32)), device.scratch_cap // 4


def _cuda_scratch_of(device):
    """The GPU products tile through the device's scratch; without a Device they stay fused."""
    return (None, 0) if device is None else _scratch_of(device)


def cuda_scratch_need(n, k, m, cap_bytes, block_size, backward):
    """Bytes of scratch a GPU product of M rows with a packed W (N, K) of `block_size` takes,
    forward or backward: a decoded tile of W above the fused sizes (the same for both), else
    the partial sums of a reduction split over blocks."""
    if m <= CUDA_FUSED_MAX_M:
        return 4 * cuda_ops.parts_elems(m, n, k, block_size, backward, cap_bytes // 4)
    return 4 * cuda_tiled.scratch_elems(n, k, cap_bytes // 4)


def _check(a, name, cols, w):
    _on_host(a, w)
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.ndim != 2 or a.shape[1] != cols:
        raise QuantError(f"{name} has shape {a.shape}; packed {w.format} weight of shape "
                         f"{tuple(w.shape)} needs (M, {cols})")
    return a


def _on_host(a, w):
    """A GPU input for host weight w is refused in words (numpy would refuse it obscurely)."""
    if not isinstance(a, np.ndarray) and hasattr(a, "__cuda_array_interface__"):
        raise wrong_device(w, True)


def _out(out, shape, name):
    if out is None:
        return np.empty(shape, np.float32)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise QuantError(f"out for {name} must be a C-contiguous float32 array of shape {shape}, "
                         f"got {out.dtype} {out.shape}")
    return out


def linear_fwd(x, w, device=None, out=None):
    """y (M, N) float32 = x (M, K) @ W.T for a PackedWeight W of logical shape (N, K); x rounded
    to 8 bits for small M inside `int8_activations()` (activations.py)."""
    if _is_cuda(w):
        scratch, cap = _cuda_scratch_of(device)
        return cuda_ops.linear_fwd(x, w, out=out, scratch=scratch, cap_elems=cap)
    N, K = (int(s) for s in w.shape)
    x = _check(x, "x", K, w)
    y = _out(out, (x.shape[0], N), "linear_fwd")
    scratch, cap = _scratch_of(device)
    return cpu_ops.linear_fwd(x, w, y, scratch, cap, int8=int8_allowed())


def linear_bwd(dy, w, device=None, out=None):
    """dx (M, K) float32 = dy (M, N) @ W for a PackedWeight W of logical shape (N, K)."""
    if _is_cuda(w):
        scratch, cap = _cuda_scratch_of(device)
        return cuda_ops.linear_bwd(dy, w, out=out, scratch=scratch, cap_elems=cap)
    N, K = (int(s) for s in w.shape)
    dy = _check(dy, "dy", N, w)
    dx = _out(out, (dy.shape[0], K), "linear_bwd")
    scratch, cap = _scratch_of(device)
    return cpu_ops.linear_bwd(dy, w, dx, scratch, cap)


def dequantize_rows(w, n0, n1, out):
    """Decode rows [n0, n1) of W (N, K) into out, a float32 (n1 - n0, K) buffer; returns out."""
    N, K = (int(s) for s in w.shape)
    if not 0 <= n0 <= n1 <= N:
        raise QuantError(f"rows [{n0}, {n1}) out of range for packed weight of shape {(N, K)}")
    _check_rows_out(out, n1 - n0, K)
    if _is_cuda(w):
        return _cuda_rows(w, w.xp.arange(n0, n1), out)
    return cpu_ops.dequantize_rows(w, n0, n1, out)


def gather_rows(w, rows, out):
    """Decode the rows `rows` (integers in [0, N), any order) of W into out, a float32
    (len(rows), K) buffer, in one kernel call; returns out."""
    N, K = (int(s) for s in w.shape)
    if not _is_cuda(w):
        _on_host(rows, w)
    rows = w.xp.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size and bool(((rows < 0) | (rows >= N)).any()):  # on a GPU: one sync, not two
        raise QuantError(f"row ids out of range [0, {N}) for packed weight of shape {(N, K)}")
    _check_rows_out(out, rows.size, K)
    if _is_cuda(w):
        return _cuda_rows(w, rows, out)
    return cpu_ops.gather_rows(w, rows, out)


def _check_rows_out(out, n, K):
    if out.shape != (n, K) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise QuantError(f"decoded rows need a C-contiguous float32 ({n}, {K}) buffer, "
                         f"got {out.dtype} {out.shape}")


def add_product(dst, a, b, device):
    """dst (M, N) += a (M, r) @ b (r, N) without an (M, N) temporary: on the CPU by BLAS
    accumulating in place, else through the device's reused scratch, a block of rows at a time.
    (BLAS beats hand-fused loops on these rank-r products by ~6x on the CPU.) A few rows add a
    temporary: the (M, N) product is small, and numpy's call costs a fifth of a ctypes BLAS
    call's (decoding, (1, 16) @ (16, 576): 2.2 against 11.9 us)."""
    if dst.shape[0] <= FEW_ROWS:
        dst += a @ b
        return
    if device.xp is np and CPU_GEMM_ACCUMULATES:
        blas.gemm(a, b, dst, 1)  # accumulates in place: no temporary at all
        return
    m, n = dst.shape
    rows = max(1, min(m, device.scratch_cap // max(4 * n, 1)))
    tmp = device.scratch(rows * n, dst.dtype).reshape(rows, n)
    for m0 in range(0, m, rows):
        m1 = min(m, m0 + rows)
        part = tmp[: m1 - m0]
        device.xp.matmul(a[m0:m1], b, out=part)
        dst[m0:m1] += part


def scatter_add(xp, out, index, g):
    """out[index] += g for an index that may repeat entries (advanced indexing, an embedding's
    ids), repeats added in the order they come: numpy's add.at on the CPU; on a GPU a kernel
    that adds the same way, the same bits on every run (cupy's add.at adds by atomics, in no
    fixed order). out C-contiguous."""
    if xp is np:
        np.add.at(out, index, g)
        return out
    return cuda_scatter.scatter_add(xp, out, index, g)


def adamw8_update(w, g, m, v, hyper):
    """One 8-bit AdamW step in place, fused per 256-value block; False where no kernel takes
    these arrays (the caller then runs its array expressions).

    w, g: float32 weights and grad; m, v: (codes uint8 (N,), absmax float32 (N/256,), map
    float32 (256,)) of the first and second moment; hyper: float32 decay, b1, one_b1, b2,
    one_b2, c2, eps, step_size (see kernels/cpu/adamw8.py)."""
    arrays = (w, g, m[0], m[1], v[0], v[1])
    if not all(type(a) is np.ndarray and a.flags.c_contiguous for a in arrays):
        return False
    if not takes(np, w, g):
        return False
    cpu_adamw8.adamw8_update(w.reshape(-1), g.reshape(-1), m[0], m[1], v[0], v[1], m[2], v[2],
                             *(np.float32(hyper[k]) for k in cpu_adamw8.HYPER))
    return True


def _cuda_rows(w, rows, out):
    return cuda_rows.gather_rows(w, rows, out)


__all__ = ["adamw8_update", "linear_fwd", "linear_bwd", "dequantize_rows", "gather_rows",
           "int8_activations", "int8_allowed", "add_product", "rmsnorm_fwd", "rmsnorm_bwd",
           "swiglu_fwd", "swiglu_bwd", "rope_rotate", "softmax_", "probs_t_", "dscores_t_",
           "query_positions", "one_query_attention", "ce_forward", "ce_backward_",
           "scatter_add",
           "DEFAULT_SCRATCH_CAP", "CPU_GEMM_ACCUMULATES", "FUSED_MAX_M", "FUSED_MAX_M_BWD",
           "CUDA_FUSED_MAX_M",
           "column_align", "tile_plan", "cuda_scratch_need"]
