"""CPU entry points for packed-weight matmuls: argument packing and fused/tiled dispatch."""
import numpy as np
from numba import get_num_threads

from ...quant.registry import FLAT
from ..format_ids import FORMAT_IDS, checked_format
from . import gemv, gemv_int
from .decode import decode_rows_par, decode_tile_par
from .fused import fused_bwd, fused_bwd_serial, fused_fwd, fused_fwd_serial
from .simd import LAYOUTS, chunk_kind
from .simd_int import INT_KINDS
from .tiled import column_align, tiled_bwd, tiled_fwd

# Batches up to this many rows use the fused kernels; larger ones decode tiles for BLAS.
# Measured on 2 cores (q4_0, backward, fused / tiled ms): 576x576 M = 16 0.14 / 0.20, but
# 1536x576 M = 16 0.73 / 0.39 (the multi-threaded fused backward pays per-thread accumulators),
# 4096x4096 M = 8 4.6 / 7.2, M = 16 9.0 / 9.4; the forward crosses over at M ≈ 8.
FUSED_MAX_M = 8
FUSED_MAX_M_BWD = 8
# Rows of x up to which 8-bit activations (gemv_int.py, when allowed) replace the float kernels.
# It decodes W once per row of x: 2 rows q4_1 576x576 21 / 28 us against fused float, 4 rows
# 39 / 39, 8 rows 74 / 58 (1536x576 at 8: 184 / 172; 4096x4096 q4_k still 2.9 / 3.7 ms).
INT8_MAX_M = 2

_U8 = np.zeros(1, np.uint8)
_I8 = np.zeros(1, np.int8)
_F32 = np.zeros(1, np.float32)
_PAIR0 = np.zeros((256, 2), np.float32)
_TAB0 = np.zeros(16, np.float32)
_TABLES = {}


def _codebook_tables(entry):
    """(pair, tab) of a table format (nf4/fp4, IQ4), built once: pair (256, 2) float32 holds a
    byte's (high, low) nibble values, tab (16,) the codebook itself."""
    if entry.name not in _TABLES:
        code = np.asarray(entry.codebook, dtype=np.float32)
        byte = np.arange(256)
        pair = np.ascontiguousarray(np.stack([code[byte >> 4], code[byte & 15]], axis=1))
        _TABLES[entry.name] = (pair, np.ascontiguousarray(code))
    return _TABLES[entry.name]


def _flat(w, name):
    return np.ascontiguousarray(w.buffers[name]).reshape(-1)


def pack_args(w):
    """The tuple `pk` the Numba kernels read (see decode.py for its fields), built once per
    weight and kept on it while its buffers stay the same arrays (a one-token step makes ~200
    packed calls; building the tuple took 1.5-2 us of each)."""
    key = tuple(map(id, w.buffers.values()))
    cached = w.__dict__.get("_kernel_args")
    if cached is not None and cached[0] == key:
        return cached[1]
    pk = _build_args(w)
    w._kernel_args = (key, pk)
    return pk


def _build_args(w):
    entry = checked_format(w)  # buffers as the registry lays them out
    K = int(w.shape[1])
    dq = bool(getattr(w, "double_quant", False))
    u8, i8, f32, pair, tab = _U8, _I8, _F32, _PAIR0, _TAB0
    aq, acode, ascale, aoff = _U8, _F32, _F32, _F32
    if entry.codebook is not None:  # nf4 / fp4, and the ggml table formats (IQ4_NL, IQ4_XS)
        pair, tab = _codebook_tables(entry)
    if entry.storage != FLAT:
        u8 = _flat(w, "blocks")
    elif entry.codebook is not None:
        u8 = _flat(w, "codes")
    else:
        i8 = _flat(w, "codes")
    if dq:
        aq, acode = _flat(w, "absmax_q"), _flat(w, "absmax_code")
        ascale, aoff = _flat(w, "absmax_scale"), _flat(w, "absmax_offset")
    elif entry.storage == FLAT:
        f32 = _flat(w, "absmax")
    bs = int(w.block_size) if entry.storage == FLAT else entry.layout.elems
    shift = max(bs // 32, 1).bit_length() - 1  # chunks of 32 per block, as a shift
    kind = chunk_kind(entry.name, dq)
    block_bytes = 0 if entry.storage == FLAT else LAYOUTS[kind].stride
    return (FORMAT_IDS[entry.name], bs, dq, K, u8, i8, f32, aq, acode, ascale, aoff, pair, tab,
            shift, kind, block_bytes, bs.bit_length() - 1)


def _small_fwd(x, pk, N, out, serial, int8):
    """A few rows of x: one row straight from the packed bytes (gemv; in integers where `int8`
    allows it for up to INT8_MAX_M rows), more through decoded groups of W's rows (fused);
    small products stay on the calling thread."""
    if int8 and x.shape[0] <= INT8_MAX_M and pk[3] % 32 == 0 and pk[14] in INT_KINDS:
        gemv_int.gemv_int_fwd(x, pk, out, 4 * get_num_threads(), serial)
    elif x.shape[0] == 1 and pk[3] % 32 == 0:
        if serial:
            gemv.gemv_fwd_serial(x, pk, out)
        else:
            gemv.gemv_fwd(x, pk, out, 4 * get_num_threads())
    elif serial:
        fused_fwd_serial(x, pk, N, out)
    else:
        fused_fwd(x, pk, N, 4 * get_num_threads(), out)


def _small_bwd(dy, pk, K, out, serial):
    """The backward counterpart of _small_fwd."""
    if dy.shape[0] == 1 and K % 32 == 0:
        if serial:
            gemv.gemv_bwd_serial(dy, pk, out)
        else:
            gemv.gemv_bwd(dy, pk, out, get_num_threads())
    elif serial:
        fused_bwd_serial(dy, pk, K, out)
    else:
        fused_bwd(dy, pk, K, get_num_threads(), out)


def linear_fwd(x, w, out, scratch, cap_elems, int8=False):
    """out (M, N) = x (M, K) @ W.T for a numpy PackedWeight; `int8`: small M may take x in
    8 bits (kernels/activations.py)."""
    pk = pack_args(w)
    N = int(w.shape[0])
    if x.shape[0] == 0:
        return out
    if x.shape[0] <= FUSED_MAX_M:
        _small_fwd(x, pk, N, out, gemv.serial(x.size * N, bwd=False), int8)
        return out
    return tiled_fwd(x, pk, N, out, scratch, cap_elems, column_align(pk[3], w.format))


def linear_bwd(dy, w, out, scratch, cap_elems):
    """out (M, K) = dy (M, N) @ W for a numpy PackedWeight."""
    pk = pack_args(w)
    K = int(w.shape[1])
    if dy.shape[0] == 0:
        return out
    if dy.shape[0] <= FUSED_MAX_M_BWD:
        _small_bwd(dy, pk, K, out, gemv.serial(dy.size * K, bwd=True))
        return out
    return tiled_bwd(dy, pk, K, out, scratch, cap_elems, column_align(pk[3], w.format))


def dequantize_rows(w, n0, n1, out):
    """Rows [n0, n1) of W into out, a float32 (n1 - n0, K) C-contiguous array."""
    pk = pack_args(w)
    decode_tile_par(pk, n0, n1, 0, pk[3], out.reshape(-1))
    return out


def gather_rows(w, rows, out):
    """Rows `rows` (int64, any order) of W into out, a float32 (len(rows), K) C-contiguous array."""
    decode_rows_par(pack_args(w), rows, out.reshape(-1))
    return out
