"""Generation's 8-bit-activation products (kernels/cpu/gemv_int.py, simd_int.py): x rounded per
32 values in numpy, W decoded by gguf's own dequantizer (the numpy reference for the flat
formats; nf4 / fp4 with their tables rounded to 8 bits), every product variant; where the flag
lets them in and where it does not."""
import gguf
import numpy as np
import packlora  # noqa: F401  (thread-pool environment before numpy/numba)
import pytest
from llvmlite import binding as llb
from numba import njit
from packlora import kernels
from packlora.kernels import linear_fwd
from packlora.kernels.cpu import gemv_int
from packlora.kernels.cpu.ops import pack_args
from packlora.kernels.cpu.simd_int import INT_KINDS, XS_STRIDE, make_int_dot
from packlora.quant import REGISTRY, quantize

from gguf_blocks import random_packed

GGML = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
        "iq4_nl", "iq4_xs"]
TABLES = ("nf4", "fp4")
_FEATS = llb.get_host_cpu_features()


def _x8(x):
    """numpy's rounding of x (M, K) to 8 bits per 32 values: (the values it stands for, xq)."""
    c = x.astype(np.float64).reshape(x.shape[0], -1, 32)
    amax = np.abs(c).max(axis=2, keepdims=True)
    d = (amax / 127).astype(np.float32).astype(np.float64)
    q = np.rint(c * np.where(amax > 0, 127 / np.where(amax > 0, amax, 1), 0))
    return (q * d).reshape(x.shape), q.reshape(x.shape)


def _table_rounded(w):
    """A table format's weights with its codebook rounded to multiples of 1/127, as the integer
    walker multiplies them (each block's absmax is its largest |value|: the tables hold +-1)."""
    code = np.asarray(REGISTRY[w.format].codebook, np.float64)
    blocks = w.dequantize().astype(np.float64).reshape(-1, w.block_size)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    idx = np.abs(blocks[..., None] / np.where(amax > 0, amax, 1)[..., None] - code).argmin(-1)
    return amax * np.rint(code[idx] * 127) / 127


def _reference(w, x):
    if w.format in GGML:
        blocks = np.asarray(w.buffers["blocks"])
        dense = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[w.format.upper()])
    elif w.format in TABLES:
        dense = _table_rounded(w)
    else:
        dense = w.dequantize()
    return _x8(x)[0] @ dense.astype(np.float64).reshape(w.shape).T


def _weight(fmt, n, k, rng):
    if fmt in GGML:
        return random_packed(fmt, n, k, rng)
    name, _, dq = fmt.partition("+")
    return quantize(rng.standard_normal((n, k)).astype(np.float32), name, block_size=64,
                    double_quant=bool(dq))


@pytest.mark.parametrize("fmt", GGML + ["int8", "nf4", "nf4+dq", "fp4"])
@pytest.mark.parametrize("m", [1, 2])
def test_int8_products_match_rounded_x_times_gguf_weights(fmt, m):
    rng = np.random.default_rng(7)
    n, k = 37, 512  # ragged rows; K a whole number of K-quant super-blocks
    w = _weight(fmt, n, k, rng)
    assert pack_args(w)[14] in INT_KINDS
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, :32] *= 40.0  # one chunk with a far larger scale than the rest
    want = _reference(w, x)
    serial, par = np.zeros((m, n), np.float32), np.zeros((m, n), np.float32)
    gemv_int.gemv_int_fwd(x, pack_args(w), serial, 1, True)
    gemv_int.gemv_int_fwd(x, pack_args(w), par, 5, False)
    scale = np.abs(want).max()
    assert np.abs(serial - want).max() <= 2e-6 * scale
    np.testing.assert_array_equal(serial, par)


def test_quantize_x_matches_numpy_and_keeps_nan():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 96)).astype(np.float32)
    x[1, 32:64] = 0.0
    x[1, 70] = np.nan
    xq = np.zeros(x.shape, np.int8)
    xs = np.zeros((2, 3 * XS_STRIDE), np.float32)
    gemv_int.quantize_x(x, xq, xs)
    vals, q = _x8(x[:1])
    np.testing.assert_array_equal(xq[0], q[0])
    np.testing.assert_allclose(xs[0, 0::XS_STRIDE], np.abs(x[0].reshape(3, 32)).max(1) / 127,
                               rtol=1e-7)
    halves = vals[0].reshape(3, 2, 16).sum(axis=2)
    np.testing.assert_allclose(xs[0, 1::XS_STRIDE], halves[:, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(xs[0, 3::XS_STRIDE], halves.sum(1), rtol=1e-5, atol=1e-6)
    assert np.all(xq[1, 32:64] == 0) and xs[1, XS_STRIDE] == 0.0
    assert np.isnan(xs[1, 2 * XS_STRIDE])  # the chunk holding the NaN
    edge = np.zeros((1, 64), np.float32)
    edge[0, :32] = np.float32(1e-38) * np.linspace(-1, 1, 32, dtype=np.float32)  # 127 / amax
    edge[0, 40] = np.inf                                                        # overflows
    gemv_int.quantize_x(edge, xq[:1, :64], xs[:1, :2 * XS_STRIDE])
    assert np.abs(xq[0, :32].astype(int)).max() <= 127 and np.isfinite(xs[0, :XS_STRIDE]).all()
    assert np.all(xq[0, 32:64] == 0) and np.isnan(xs[0, XS_STRIDE:2 * XS_STRIDE]).all()
    w = random_packed("q4_k", 3, 256, rng)
    y = np.zeros((1, 3), np.float32)
    x2 = rng.standard_normal((1, 256)).astype(np.float32)
    x2[0, 200] = np.nan
    gemv_int.gemv_int_fwd(x2, pack_args(w), y, 1, True)
    assert np.isnan(y).all()


def _usable(variant):
    need = {"vnni": ("avx512vnni", "avx512vl"), "avx2": ("avx2",), "generic": ()}[variant]
    return all(_FEATS.get(f) for f in need)


@pytest.mark.parametrize("variant", ["vnni", "avx2", "generic"])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q6_k", "q4_k", "nf4", "iq4_xs"])
def test_product_variants(variant, fmt):
    if not _usable(variant):
        pytest.skip(f"this CPU lacks {variant}")
    run = make_int_dot(variant)

    @njit
    def rows(pk, xq, xs, y):
        K = pk[3]
        for n in range(y.size):
            if pk[15]:  # ggml rows: whole blocks, pk[15] bytes each
                y[n] = run(pk[14], pk, n * (K >> pk[16]) * pk[15], K // 32, 0, 0, xq, xs, 0)
            else:  # 4-bit flat codes: two a byte, one absmax per 2^pk[13] chunks
                y[n] = run(pk[14], pk, n * K // 2, K // 32, n * K // 32, pk[13], xq, xs, 0)

    rng = np.random.default_rng(11)
    w = _weight(fmt, 5, 256, rng)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    xq = np.zeros(x.shape, np.int8)
    xs = np.zeros((1, 8 * XS_STRIDE), np.float32)
    gemv_int.quantize_x(x, xq, xs)
    y = np.zeros(5, np.float32)
    rows(pack_args(w), xq[0], xs[0], y)
    want = _reference(w, x)[0]
    assert np.abs(y - want).max() <= 2e-6 * np.abs(want).max()


def test_only_inside_the_block_and_only_integer_formats():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    q4k = random_packed("q4_k", 8, 256, rng)
    f16 = quantize(rng.standard_normal((8, 256)).astype(np.float32), "f16")
    outside = linear_fwd(x, q4k)
    with kernels.int8_activations():
        inside = linear_fwd(x, q4k)
        f16_inside = linear_fwd(x, f16)
        three = linear_fwd(np.repeat(x, 3, axis=0), q4k)  # more rows than INT8_MAX_M
        with kernels.int8_activations(False):
            nested_off = linear_fwd(x, q4k)
    np.testing.assert_array_equal(nested_off, outside)
    np.testing.assert_array_equal(f16_inside, linear_fwd(x, f16))  # 16-bit floats keep float x
    np.testing.assert_allclose(three, np.repeat(outside, 3, axis=0), rtol=1e-5, atol=1e-5)
    want = _reference(q4k, x)
    assert np.abs(inside - want).max() <= 2e-6 * np.abs(want).max()
    assert not np.array_equal(inside, outside)
    assert not kernels.int8_allowed()
