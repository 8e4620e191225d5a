"""CPU packed-weight kernels against the float64 product with the dequantized weight."""
import tracemalloc

import numpy as np
import packlora  # noqa: F401  (thread-pool environment before numpy/numba)
import pytest
from packlora import Device, QuantError
from packlora.kernels import dequantize_rows, gather_rows, linear_bwd, linear_fwd
from packlora.kernels.cpu import ops as cpu_ops
from packlora.quant import PackedWeight, quantize

from gguf_blocks import random_packed

# (format, double_quant, block_size, shapes): shapes are ragged on purpose (K not a multiple of
# the block, odd numel so the last byte holds a pad nibble, N=1, odd N).
CASES = [
    ("nf4", False, 64, [(33, 71), (1, 200)]),
    ("nf4", True, 64, [(33, 71), (5, 520)]),
    ("fp4", False, 64, [(9, 37)]),
    ("fp4", True, 32, [(9, 37)]),
    ("int8", False, 64, [(33, 71), (3, 50)]),
    ("q4_0", None, None, [(7, 96), (1, 32)]),
    ("q4_1", None, None, [(7, 96)]),
    ("q8_0", None, None, [(7, 96), (4, 64)]),
    # K a multiple of 32: the SIMD walkers, blocks straddling rows (96 % 64) included
    ("nf4", False, 64, [(5, 96), (3, 256)]),
    ("nf4", True, 128, [(6, 96)]),
    ("fp4", False, 256, [(7, 160)]),
    ("fp4", True, 32, [(3, 64)]),
    ("int8", False, 32, [(5, 96)]),
    ("int8", False, 128, [(4, 192)]),
    # 5-bit blocks of 32 and the K-quants' super-blocks of 256 (random blocks: gguf_blocks.py)
    ("q5_0", None, None, [(7, 96), (1, 32)]),
    ("q5_1", None, None, [(7, 96)]),
    ("q2_k", None, None, [(5, 256)]),
    ("q3_k", None, None, [(5, 512)]),
    ("q4_k", None, None, [(7, 512), (1, 256)]),
    ("q5_k", None, None, [(5, 256)]),
    ("q6_k", None, None, [(7, 512), (1, 256)]),
    # 4-bit codes in IQ4's table: blocks of 32, super-blocks of 256 (random blocks)
    ("iq4_nl", None, None, [(7, 96), (1, 32)]),
    ("iq4_xs", None, None, [(7, 512), (1, 256)]),
    # 16-bit floats kept in 16 bits (subnormal halves in row 0, zeros in row 1)
    ("f16", None, None, [(7, 96), (1, 32)]),
    ("bf16", None, None, [(7, 96), (3, 64)]),
]
# formats not quantized from float here: their weights are random blocks (gguf_blocks.py)
RANDOM_BLOCKS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")
PARAMS = [(f, dq, bs, s) for f, dq, bs, shapes in CASES for s in shapes]
MS = (1, 7, 12, 64, 300)  # fused (gemv at M = 1), then tiled from M = 12


def _weight(fmt, dq, bs, shape, seed=0):
    rng = np.random.default_rng(seed)
    if fmt in RANDOM_BLOCKS:
        return random_packed(fmt, *shape, rng)
    w = rng.standard_normal(shape).astype(np.float32)
    w[0, : min(shape[1], 32)] *= 1e-5  # GGUF: fp16 scales that are subnormal
    if shape[0] > 2:
        w[1] = 0.0  # a zero scale
    kwargs = {} if dq is None else {"block_size": bs, "double_quant": dq}
    return quantize(w, fmt, **kwargs)


def _close(got, want):
    scale = np.abs(want).max() + 1e-30
    err = np.abs(got.astype(np.float64) - want).max() / scale
    assert err < 2e-5, f"relative error {err:.2e}"


@pytest.mark.parametrize("fmt,dq,bs,shape", PARAMS, ids=[f"{p[0]}-dq{p[1]}-{p[3]}" for p in PARAMS])
def test_fwd_bwd_match_dequantized(fmt, dq, bs, shape):
    w = _weight(fmt, dq, bs, shape)
    W = w.dequantize().astype(np.float64)  # (N, K)
    N, K = shape
    rng = np.random.default_rng(1)
    dev = Device.cpu()
    for M in MS:
        x = rng.standard_normal((M, K)).astype(np.float32)
        dy = rng.standard_normal((M, N)).astype(np.float32)
        y = linear_fwd(x, w, device=dev)
        assert y.shape == (M, N) and y.dtype == np.float32
        _close(y, x.astype(np.float64) @ W.T)
        dx = linear_bwd(dy, w)
        assert dx.shape == (M, K) and dx.dtype == np.float32
        _close(dx, dy.astype(np.float64) @ W)


@pytest.mark.parametrize("fmt,dq,bs", [("nf4", True, 64), ("int8", False, 64), ("q4_1", None, None),
                                       ("nf4", False, 32)])
def test_parallel_small_batch_paths(fmt, dq, bs, monkeypatch):
    """The multi-threaded gemv/fused kernels (normally only for large weights) on small ones."""
    monkeypatch.setattr(cpu_ops.gemv, "PARALLEL_MIN", 0)
    monkeypatch.setattr(cpu_ops.gemv, "PARALLEL_MIN_BWD", 0)
    monkeypatch.setattr(cpu_ops.gemv, "WORKQUEUE_MIN", 0)
    for shape in ((37, 96), (37, 90)) if fmt != "q4_1" else ((37, 96),):
        w = _weight(fmt, dq, bs, shape)
        W = w.dequantize().astype(np.float64)
        rng = np.random.default_rng(4)
        for M in (1, 3, 12):
            x = rng.standard_normal((M, shape[1])).astype(np.float32)
            dy = rng.standard_normal((M, shape[0])).astype(np.float32)
            _close(linear_fwd(x, w), x @ W.T)
            _close(linear_bwd(dy, w), dy @ W)


@pytest.mark.parametrize("fmt", ["nf4", "int8", "q4_1", "q8_0"])
def test_tiny_scratch_splits_every_axis(fmt):
    """A 256-byte cap forces the tiled path to split K (fwd), N (bwd) and the batch."""
    w = _weight(fmt, True if fmt == "nf4" else None, 64, (37, 96) if fmt[0] == "q" else (37, 90))
    W = w.dequantize().astype(np.float64)
    dev = Device.cpu()
    old = dev.scratch_cap
    dev.set_scratch_cap(256)
    try:
        x = np.random.default_rng(2).standard_normal((100, W.shape[1])).astype(np.float32)
        dy = np.random.default_rng(3).standard_normal((100, W.shape[0])).astype(np.float32)
        out = np.full((100, W.shape[0]), np.nan, np.float32)
        assert linear_fwd(x, w, device=dev, out=out) is out
        _close(out, x @ W.T)
        _close(linear_bwd(dy, w, device=dev), dy @ W)
    finally:
        dev.set_scratch_cap(old)


@pytest.mark.parametrize("fmt,dq", [("nf4", True), ("fp4", False), ("int8", False), ("q4_0", None)])
def test_dequantize_rows(fmt, dq):
    w = _weight(fmt, dq, 64, (11, 96))
    W = w.dequantize()
    out = np.empty((5, 96), np.float32)
    assert dequantize_rows(w, 3, 8, out) is out
    np.testing.assert_allclose(out, W[3:8], rtol=1e-6, atol=1e-7)
    with pytest.raises(QuantError):
        dequantize_rows(w, 8, 12, np.empty((4, 96), np.float32))


@pytest.mark.parametrize("fmt,dq", [("nf4", True), ("fp4", False), ("int8", False), ("q4_1", None)])
def test_gather_rows(fmt, dq):
    w = _weight(fmt, dq, 64, (11, 96))
    rows = np.array([10, 0, 10, 4, 7], dtype=np.int64)
    out = gather_rows(w, rows, np.empty((5, 96), np.float32))
    np.testing.assert_array_equal(out, w.dequantize()[rows])
    assert gather_rows(w, rows[:0], np.empty((0, 96), np.float32)).shape == (0, 96)
    for bad in ([11], [3, -1]):
        with pytest.raises(QuantError, match="out of range"):
            gather_rows(w, np.array(bad), np.empty((len(bad), 96), np.float32))


def test_bad_shapes_name_the_tensor():
    w = _weight("nf4", False, 64, (8, 64))
    with pytest.raises(QuantError, match="x has shape"):
        linear_fwd(np.zeros((2, 63), np.float32), w)
    with pytest.raises(QuantError, match="dy has shape"):
        linear_bwd(np.zeros((2, 9), np.float32), w)
    with pytest.raises(QuantError, match="out"):
        linear_fwd(np.zeros((2, 64), np.float32), w, out=np.zeros((2, 9), np.float32))


def _big_nf4(N, K, rng):
    numel = N * K
    buffers = {"codes": rng.integers(0, 256, numel // 2, dtype=np.uint8),
               "absmax": rng.random(numel // 64, dtype=np.float32) + 0.5}
    return PackedWeight("nf4", (N, K), buffers, 64, False)


def test_large_batch_memory_stays_within_scratch_cap():
    """4096x4096 NF4, M=512: no more than the scratch cap beyond the output, fwd and bwd."""
    rng = np.random.default_rng(0)
    N = K = 4096
    M = 512
    w = _big_nf4(N, K, rng)
    x = rng.standard_normal((M, K), dtype=np.float32)
    dy = rng.standard_normal((M, N), dtype=np.float32)
    dev = Device.cpu()
    cap = dev.scratch_cap
    dev.set_scratch_cap(cap)  # drop any scratch so its allocation is measured below
    dev.memory.reset_peak()  # earlier tests on this shared device may have peaked higher
    slack = 64 << 10
    for fn, a, out_bytes in ((linear_fwd, x, M * N * 4), (linear_bwd, dy, M * K * 4)):
        fn(a[:100], w, device=dev)  # the kernels compiled or loaded from Numba's cache first
        dev.set_scratch_cap(cap)
        tracemalloc.start()
        fn(a, w, device=dev)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak - out_bytes <= cap + slack, f"{fn.__name__}: {peak - out_bytes} extra bytes"
    assert 0 < dev.memory.peak["dense_scratch"] <= cap
    rows = dequantize_rows(w, 0, 8, np.empty((8, K), np.float32)).astype(np.float64)
    _close(linear_fwd(x, w, device=dev)[:, :8], x.astype(np.float64) @ rows.T)
    dy[:, 8:] = 0.0  # only the first rows of W contribute: a cheap exact reference
    _close(linear_bwd(dy, w, device=dev), dy[:, :8].astype(np.float64) @ rows)


def test_fused_and_tiled_paths_agree():
    w = _weight("q4_1", None, None, (40, 64))
    x = np.random.default_rng(4).standard_normal((16, 64)).astype(np.float32)
    old = cpu_ops.FUSED_MAX_M, cpu_ops.FUSED_MAX_M_BWD
    try:
        cpu_ops.FUSED_MAX_M = cpu_ops.FUSED_MAX_M_BWD = 1000
        fused = (linear_fwd(x, w), linear_bwd(x[:, :40].copy(), w))
        cpu_ops.FUSED_MAX_M = cpu_ops.FUSED_MAX_M_BWD = 0
        tiled = (linear_fwd(x, w), linear_bwd(x[:, :40].copy(), w))
    finally:
        cpu_ops.FUSED_MAX_M, cpu_ops.FUSED_MAX_M_BWD = old
    for a, b in zip(fused, tiled):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block,whole_rows_min,row_block_min",
                         [(None, 512, 2048), (64, 512, 2048), (64, 16, 2048), (64, 64, 64)])
def test_tiled_products_cut_as_planned(block, whole_rows_min, row_block_min, monkeypatch):
    """Tiled products split along the reduction in multiples of BLAS's reduction block (or in
    balanced chunks where it is unknown), with a ragged last chunk; the forward takes whole rows
    of W where the plan says so. Forward and backward against the dequantized weight."""
    from packlora.kernels.cpu import blas, ops, tiled
    assert blas.REDUCTION_BLOCK is None or blas.REDUCTION_BLOCK in blas._GEMM_Q.values()
    monkeypatch.setattr(tiled, "REDUCTION_BLOCK", block)
    monkeypatch.setattr(tiled, "WHOLE_ROWS_MIN", whole_rows_min)
    monkeypatch.setattr(tiled, "ROW_BLOCK_MIN_R", row_block_min)
    rng = np.random.default_rng(5)
    w = quantize(rng.standard_normal((96, 416), dtype=np.float32), "q4_0")
    x = rng.standard_normal((20, 416), dtype=np.float32)
    dy = rng.standard_normal((20, 96), dtype=np.float32)
    W = w.dequantize().astype(np.float64)
    cap = 96 * 128
    # forward: whole rows (29 fit, balanced to 24), blocks of 64 rows by chunks of 192 (the
    # last ones 32 rows, 32 values), chunks of 128 (two blocks; the last one 32), or rows with
    # the whole reduction because no chunk of RC_MIN fits
    want = ((24, 416) if whole_rows_min == 16 else (64, 192) if row_block_min == 64
            else (96, 128) if block else (24, 416))
    assert tiled.plan(96, 416, cap, 1, 32, block, m=20) == want
    assert tiled.plan(96, 416, cap, 1, 32, block) == ((96, 128) if block else (24, 416))
    assert tiled.plan(416, 96, cap, 32, 1, block) == ((192, 64) if block else (128, 96))
    buf = np.empty(cap, np.float32)
    y = ops.linear_fwd(x, w, np.empty((20, 96), np.float32), lambda n: buf[:n], cap)
    np.testing.assert_allclose(y, x @ W.T, rtol=1e-4, atol=1e-3)
    dx = ops.linear_bwd(dy, w, np.empty((20, 416), np.float32), lambda n: buf[:n], cap)
    np.testing.assert_allclose(dx, dy @ W, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("through_blas", [True, False])
def test_gemm_accumulates_on_strided_views(through_blas, monkeypatch):
    """blas.gemm: C = A @ B + beta C on column slices and transposed views, through CBLAS and
    through its numpy fallback; LoRA's add_product on both paths."""
    from packlora.kernels import add_product
    from packlora.kernels.cpu import blas
    if not through_blas:
        monkeypatch.setattr(blas, "SGEMM", None)
    elif blas.SGEMM is None:
        pytest.skip("no CBLAS sgemm found next to numpy or on the system")
    rng = np.random.default_rng(11)
    x = rng.standard_normal((7, 40), dtype=np.float32)
    tile = rng.standard_normal((9, 24), dtype=np.float32)
    out = rng.standard_normal((7, 30), dtype=np.float32)
    want = out.astype(np.float64)
    want[:, 3:12] += x[:, 8:32].astype(np.float64) @ tile.T.astype(np.float64)
    blas.gemm(x[:, 8:32], tile.T, out[:, 3:12], 1)  # a column slice, a transposed tile
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    blas.gemm(x[:, :24], tile.T, out[:, 3:12], 0)
    np.testing.assert_allclose(out[:, 3:12], x[:, :24] @ tile.T, rtol=1e-5, atol=1e-5)
    dst = rng.standard_normal((50, 30), dtype=np.float32)
    a = rng.standard_normal((50, 4), dtype=np.float32)
    b = rng.standard_normal((30, 4), dtype=np.float32)
    want = dst + a @ b.T
    dev = Device.cpu()
    dev.set_scratch_cap(1024)  # the scratch path goes a few rows at a time
    add_product(dst, a, b.T, dev)
    np.testing.assert_allclose(dst, want, rtol=1e-5, atol=1e-5)
    wide = rng.standard_normal((3, 40), dtype=np.float32)
    want = wide[:, 5:35] + a[:3] @ b.T
    add_product(wide[:, 5:35], a[:3], b.T, dev)  # a few rows (numpy, a temporary), a view
    np.testing.assert_allclose(wide[:, 5:35], want, rtol=1e-5, atol=1e-5)


def test_kernel_args_follow_replaced_buffers():
    """The kernels' argument tuple is kept on the weight, and rebuilt when a buffer is replaced
    by another array (e.g. codes edited and assigned back)."""
    rng = np.random.default_rng(8)
    w = quantize(rng.standard_normal((40, 64), dtype=np.float32), "nf4")
    x = rng.standard_normal((3, 64), dtype=np.float32)
    assert cpu_ops.pack_args(w) is cpu_ops.pack_args(w)
    np.testing.assert_allclose(linear_fwd(x, w), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)
    w.buffers["codes"] = w.buffers["codes"][::-1].copy()
    np.testing.assert_allclose(linear_fwd(x, w), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)
