"""Device and autodiff semantics: the API contract of the foundation."""
import numpy as np
import packlora as pl
import pytest
from packlora import ops


def test_device_parse_roundtrip_and_equality():
    cpu = pl.Device.cpu()
    assert cpu.xp is np
    for dev in (cpu, cpu.autodiff()):
        assert pl.Device.parse(str(dev)) == dev
    assert pl.Device.parse("CPU") == cpu
    assert cpu != cpu.autodiff()
    assert cpu.autodiff().inner() == cpu
    assert cpu.autodiff().is_autodiff() and not cpu.is_autodiff()
    with pytest.raises(pl.DeviceError, match="already records"):
        cpu.autodiff().autodiff()
    with pytest.raises(pl.DeviceError):
        pl.Device.parse("tpu")
    with pytest.raises(pl.DeviceError):
        pl.Device.parse("cuda:x")


def test_cuda_without_gpu_is_a_clear_error():
    try:
        import cupy  # noqa: F401
        pytest.skip("cupy present: the no-GPU message is not reachable here")
    except ImportError:
        pass
    with pytest.raises(pl.DeviceError, match=r"packlora\[cuda\]"):
        pl.Device.cuda(0)
    with pytest.raises(pl.DeviceError):
        pl.Device.parse("cuda:1")


def test_tf32_is_refused_on_the_cpu():
    cpu = pl.Device.cpu()
    cpu.set_tf32(False)  # nothing to turn off
    assert cpu.tf32 is False
    with pytest.raises(pl.DeviceError, match="tf32 needs a CUDA device"):
        cpu.autodiff().set_tf32(True)


def test_seed_reproducible():
    dev = pl.Device.cpu()
    dev.seed(7)
    a = pl.randn((4, 4), dev).numpy()
    dev.seed(7)
    b = pl.randn((4, 4), dev).numpy()
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.float32
    dev.sync()


def test_constructors_and_dtypes():
    dev = pl.Device.cpu()
    assert pl.zeros((2, 3), dev).dtype == np.float32
    assert pl.ones((2,), dev, dtype=np.float64).dtype == np.float64
    assert pl.full((2,), 3.0, dev).numpy().tolist() == [3.0, 3.0]
    assert pl.Tensor([1.5, 2.0], dev).dtype == np.float32
    assert pl.Tensor([1, 2], dev).dtype.kind == "i"
    t = pl.Tensor.from_numpy(np.arange(6, dtype=np.float64).reshape(2, 3))
    assert t.shape == (2, 3) and t.dtype == np.float64
    assert isinstance(t.numpy(), np.ndarray)
    assert (t + 1).dtype == np.float64  # Python scalars keep the tensor's dtype
    assert (pl.ones((2,), dev) * 2.5).dtype == np.float32


def test_require_grad_only_on_leaves_and_tracking():
    dev = pl.Device.cpu().autodiff()
    x = pl.ones((2, 2), dev).require_grad()
    y = x * 2
    assert x.is_require_grad() and x.is_tracked() and y.is_tracked()
    with pytest.raises(pl.AutodiffError, match="leaf"):
        y.require_grad()
    z = y.detach()
    assert not z.is_tracked() and z._fn is None
    with pl.without_autodiff():
        w = x * 3
    assert not w.is_tracked()
    plain = pl.ones((2, 2), pl.Device.cpu()).require_grad()
    assert not (plain * 2).is_tracked()  # a device without autodiff never records


def test_backward_accumulates_and_frees():
    dev = pl.Device.cpu().autodiff()
    x = pl.Tensor(np.array([1.0, 2.0, 3.0]), dev).require_grad()
    loss = (x * x).sum()
    loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), [2, 4, 6])
    with pytest.raises(pl.AutodiffError, match="recompute the loss"):
        loss.backward()
    (x * x).sum().backward()  # a fresh graph accumulates
    np.testing.assert_allclose(x.grad.numpy(), [4, 8, 12])
    with pytest.raises(pl.AutodiffError, match="scalar"):
        (x * 2).backward()


def test_shared_subgraph_consumed_error():
    dev = pl.Device.cpu().autodiff()
    x = pl.ones((3,), dev).require_grad()
    h = x * 2
    l1, l2 = h.sum(), (h * h).sum()
    l1.backward()
    with pytest.raises(pl.AutodiffError, match="sum the losses"):
        l2.backward()


def test_saved_state_released_and_burn_rule():
    dev = pl.Device.cpu().autodiff()
    w = pl.ones((3, 3), dev).require_grad()
    x = pl.ones((3, 3), dev)  # does not require grad
    y = x @ w
    saved = y._fn.saved
    assert saved[1] is not None and saved[0] is None  # only x is saved: w's grad needs it
    fn = y._fn
    y.sum().backward()
    assert fn.saved == () and fn.parents == ()


def test_mixing_devices_is_an_error():
    a = pl.ones((2,), pl.Device.cpu())
    b = pl.ones((2,), pl.Device.cpu().autodiff())
    assert (a + b).shape == (2,)  # same hardware mixes fine

    class Other(pl.Device):
        pass
    c = pl.ones((2,), pl.Device.cpu())
    c.device = object.__new__(Other)
    c.device.kind, c.device.index, c.device._autodiff = "cuda", 3, False
    with pytest.raises(pl.DeviceError, match="mixes"):
        a + c


def test_to_device_keeps_state():
    dev = pl.Device.cpu().autodiff()
    x = pl.ones((2,), dev).require_grad()
    y = x.to_device(pl.Device.cpu().autodiff())
    assert y.is_require_grad() and y.device.is_autodiff()


def test_toy_network_trains_with_sgd():
    dev = pl.Device.cpu().autodiff()
    dev.seed(0)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((256, 2)).astype(np.float32)
    ys = (xs[:, 0] * xs[:, 1] > 0).astype(np.int64)  # XOR-like quadrants
    w1 = (pl.randn((2, 32), dev) * 0.5).detach().require_grad()
    b1 = pl.zeros((32,), dev).require_grad()
    w2 = (pl.randn((32, 2), dev) * 0.5).detach().require_grad()
    b2 = pl.zeros((2,), dev).require_grad()
    params = [w1, b1, w2, b2]
    x = pl.Tensor(xs, dev)
    for _ in range(300):
        h = ops.silu(x @ w1 + b1)
        loss = ops.cross_entropy(h @ w2 + b2, ys)
        loss.backward()
        for p in params:
            p.data -= 0.5 * p.grad.data
            p.grad = None
    assert loss.item() < 0.15, loss.item()


def test_package_mapping():
    import packlora.kernels
    import packlora.quant
    assert packlora.quant.__name__ == "packlora.quant"
    assert packlora.kernels.__name__ == "packlora.kernels"
