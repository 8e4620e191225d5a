"""CUDA packed-linear kernels on a real GPU (cupy), against cupy's products on the dense weight;
skipped with the reason where there is none (the simulator's tests: test_kernels_cuda.py)."""
import numpy as np
import pytest
from gguf_blocks import random_packed
from numba import config, cuda
from packlora import Device, Tensor, kernels
from packlora import ops as pl_ops
from packlora.errors import DeviceError
from packlora.kernels.cuda import launch, ops
from packlora.kernels.cuda.launch import weight_args
from packlora.quant import quantize
from test_kernels_cuda import RANDOM_BLOCKS, VARIANTS


def _cupy():
    try:
        import cupy
    except ImportError:
        pytest.skip("no CUDA GPU: cupy not installed")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA GPU: no device found")
    except cupy.cuda.runtime.CUDARuntimeError as e:
        pytest.skip(f"no CUDA GPU: {e}")
    if config.ENABLE_CUDASIM:
        pytest.skip("NUMBA_ENABLE_CUDASIM is set in this process; real-GPU test not possible")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,dq", VARIANTS)
@pytest.mark.parametrize("m", [1, 13, 300])
def test_gpu_matches_dense(fmt, dq, m):
    cp = _cupy()
    rng = np.random.default_rng(1)
    w = quantize(rng.standard_normal((576, 1536)).astype(np.float32), fmt, double_quant=dq)
    _gpu_check_products(cp, w, m, rng, f"{fmt} dq={dq}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", RANDOM_BLOCKS)
@pytest.mark.parametrize("m", [1, 13])
def test_gpu_kquants_match_dense(fmt, m):
    cp = _cupy()
    rng = np.random.default_rng(3)
    _gpu_check_products(cp, random_packed(fmt, 576, 1536, rng), m, rng, fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,dq,n", [("nf4", True, 576), ("q8_0", False, 570),
                                      ("q4_k", False, 574)])
@pytest.mark.parametrize("m", [5, 16])
def test_gpu_gemv_for_up_to_16_rows(monkeypatch, fmt, dq, n, m):
    """The GEMV kernels built for 16 rows (GEMV_MAX_M raised as bench/kernels_cuda.py does);
    N not a multiple of the forward warp's rows of W."""
    cp = _cupy()
    monkeypatch.setattr(ops, "GEMV_MAX_M", ops.gemv.MAX_M)
    rng = np.random.default_rng(4)
    w = (random_packed(fmt, n, 1536, rng) if fmt in RANDOM_BLOCKS else
         quantize(rng.standard_normal((n, 1536)).astype(np.float32), fmt, double_quant=dq))
    _gpu_check_products(cp, w, m, rng, f"{fmt} dq={dq} N={n}")


def _gpu_check_products(cp, w, m, rng, what):
    """Forward and backward of host weight w moved to the GPU against cupy on its dense form,
    twice: the second call replays the first's launches (kernels/cuda/prepared.py)."""
    n, k = w.shape
    dense = cp.asarray(w.dequantize())                                  # (N, K)
    wd = w.to_device(Device.cuda(0))
    for call in ("first", "replayed"):
        x = cp.asarray(rng.standard_normal((m, k)).astype(np.float32))      # (M, K)
        dy = cp.asarray(rng.standard_normal((m, n)).astype(np.float32))     # (M, N)
        y = ops.linear_fwd(x, wd) if call == "first" else ops.linear_fwd(
            x, wd, out=cp.full((m, n), cp.nan, dtype=cp.float32))  # every element written
        out = cp.full((m, k), cp.nan, dtype=cp.float32)
        dx = ops.linear_bwd(dy, wd, out=out)
        assert isinstance(y, cp.ndarray) and dx is out
        for got, ref in [(y, x @ dense.T), (dx, dy @ dense)]:
            err = float(cp.abs(got - ref).max() / cp.abs(ref).max())
            assert err < 1e-4, f"{what} M={m}, {call} call: rel err {err}"
    replays = launch._kept(wd, cp).prepared
    assert replays and all(p is not None for p in replays.values()), (what, replays)
    with pytest.raises(DeviceError, match="w.to_device"):
        ops.linear_fwd(x, w)                                            # w still on the host
    with pytest.raises(DeviceError, match="w.to_device"):
        kernels.linear_fwd(x, w)                                        # ... through the entry
    np.testing.assert_array_equal(wd.to_device(Device.cpu()).dequantize(), w.dequantize())


@pytest.mark.gpu
@pytest.mark.parametrize("in_kernel", [True, False])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_products_give_the_same_bits_every_time(monkeypatch, m, in_kernel):
    """The reductions split across blocks (the GEMV backward, the tile's at M <= 16 on a wide
    K) add their parts in a fixed order, not by atomics, whether the last block of each output
    tile adds them or a cupy sum after the launch: twenty calls, one result to the bit."""
    cp = _cupy()
    monkeypatch.setattr(ops, "SUM_PARTS_IN_KERNEL", in_kernel)
    rng = np.random.default_rng(5)
    dev = Device.cuda(0)
    w = quantize(rng.standard_normal((1024, 4096)).astype(np.float32), "nf4",
                 double_quant=True).to_device(dev)
    assert ops.parts_elems(m, 1024, 4096, w.block_size, True) > 0       # the backward splits
    x = cp.asarray(rng.standard_normal((m, 4096)).astype(np.float32))   # (M, K)
    dy = cp.asarray(rng.standard_normal((m, 1024)).astype(np.float32))  # (M, N)
    for product, a in ((kernels.linear_fwd, x), (kernels.linear_bwd, dy)):
        first = product(a, w, dev)
        for _ in range(20):
            assert bool(cp.array_equal(product(a, w, dev), first)), (product.__name__, m)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,k", [("nf4", 4096), ("q4_k", 1024), ("q8_0", 2048)])
@pytest.mark.parametrize("m", [1, 4, 13])
def test_gpu_parts_added_in_the_kernel_match_a_sum_after_it(monkeypatch, fmt, k, m):
    """The last block of each output tile adds the parts (parts.py) to what cupy's sum of the
    same parts gives, up to the order of its additions, and to the dense product; K = 1,024
    gives the GEMV backward its most parts (one column block)."""
    cp = _cupy()
    rng = np.random.default_rng(7)
    dev = Device.cuda(0)
    w = (random_packed(fmt, 1536, k, rng) if fmt == "q4_k" else
         quantize(rng.standard_normal((1536, k)).astype(np.float32), fmt)).to_device(dev)
    dense = cp.asarray(w.dequantize())                                  # (N, K)
    x = cp.asarray(rng.standard_normal((m, k)).astype(np.float32))      # (M, K)
    dy = cp.asarray(rng.standard_normal((m, 1536)).astype(np.float32))  # (M, N)
    assert ops.parts_elems(m, 1536, k, w.block_size, True) > 0          # the backward splits
    for product, a, ref in ((kernels.linear_fwd, x, x @ dense.T),
                            (kernels.linear_bwd, dy, dy @ dense)):
        monkeypatch.setattr(ops, "SUM_PARTS_IN_KERNEL", True)
        inside = product(a, w, dev)
        monkeypatch.setattr(ops, "SUM_PARTS_IN_KERNEL", False)
        after = product(a, w, dev)
        scale = float(cp.abs(ref).max())
        assert float(cp.abs(inside - after).max()) <= 3e-5 * scale, (product.__name__, m)
        assert float(cp.abs(inside - ref).max()) <= 1e-4 * scale, (product.__name__, m)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nf4", "q4_k", "q8_0"])
@pytest.mark.parametrize("m", [1, 3])
def test_gpu_gemv_backward_two_rows_of_w_at_a_time_give_the_same_bits(monkeypatch, fmt, m):
    """gemv.BWD_ROWS = 2 (timed by bench/kernels_cuda.py as gemv_rows2) makes the same
    multiply-adds in the same order as one row at a time: the same bits on the GPU."""
    cp = _cupy()
    rng = np.random.default_rng(8)
    dev = Device.cuda(0)
    n, k = 1537, 2048  # chunks of W's rows odd and even
    w = (random_packed(fmt, n, k, rng) if fmt == "q4_k" else
         quantize(rng.standard_normal((n, k)).astype(np.float32), fmt)).to_device(dev)
    dy = cp.asarray(rng.standard_normal((m, n)).astype(np.float32))     # (M, N)
    got = []
    for rows in (1, 2):
        monkeypatch.setattr(ops.gemv, "BWD_ROWS", rows)
        got.append(kernels.linear_bwd(dy, w, dev))
    assert bool(cp.array_equal(*got)), (fmt, m)


@pytest.mark.gpu
def test_gpu_gradients_through_repeated_indices_give_numpys_bits():
    """An embedding's gradient and advanced indexing's scatter their rows by a kernel that adds
    repeats in order (kernels/cuda/scatter.py), not by cupy's atomics: numpy's add.at's bits,
    on every run."""
    cp = _cupy()
    rng = np.random.default_rng(6)
    dev = Device.cuda(0).autodiff()
    w0 = rng.standard_normal((50, 576)).astype(np.float32)               # (V, D)
    ids = rng.integers(0, 50, (8, 512))                                  # (B, T): many repeats
    g = rng.standard_normal((8, 512, 576)).astype(np.float32)            # (B, T, D)
    want = np.zeros_like(w0)
    np.add.at(want, ids.reshape(-1), g.reshape(-1, 576))
    rows = np.array([3, -1, 3, 7, 3])
    gi = rng.standard_normal((5, 576)).astype(np.float32)
    want_at = np.zeros_like(w0)
    np.add.at(want_at, rows, gi)
    for _ in range(3):
        w = Tensor(w0, dev).require_grad()
        pl_ops.embedding(w, ids).backward(cp.asarray(g))
        assert np.array_equal(w.grad.numpy(), want)
        w = Tensor(w0, dev).require_grad()
        pl_ops.getitem(w, cp.asarray(rows)).backward(cp.asarray(gi))
        assert np.array_equal(w.grad.numpy(), want_at)


@pytest.mark.gpu
def test_gpu_weight_args_are_kept_device_views():
    cp = _cupy()
    rng = np.random.default_rng(2)
    dev = Device.cuda(0)
    w, other = (quantize(rng.standard_normal((64, 256)).astype(np.float32), "q8_0")
                .to_device(dev) for _ in range(2))
    first = weight_args(w, cp)
    assert weight_args(w, cp) is first
    assert all(cuda.is_cuda_array(a) and not isinstance(a, cp.ndarray) for a in first
               if not isinstance(a, int))
    x = cp.asarray(rng.standard_normal((3, 256)).astype(np.float32))   # (M, K)
    w.buffers["blocks"] = other.buffers["blocks"]
    ref = x @ cp.asarray(other.dequantize()).T
    assert float(cp.abs(ops.linear_fwd(x, w) - ref).max() / cp.abs(ref).max()) < 1e-5
