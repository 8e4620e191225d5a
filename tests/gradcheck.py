"""Central finite-difference gradient checks for packlora ops (float64), and a tracemalloc
window for tests that measure what a call allocates."""
import contextlib
import tracemalloc

import numpy as np
import packlora as pl

DEV = pl.Device.cpu().autodiff()


def leaf(shape, seed=0, scale=1.0, positive=False):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape) * scale
    if positive:
        a = np.abs(a) + 0.5
    return pl.Tensor(a, DEV).require_grad()


def check(fn, inputs, eps=1e-6, rtol=1e-5, atol=1e-7, seed=123):
    """Compare autodiff gradients of sum(fn(*inputs) * R) with central differences."""
    out = fn(*inputs)
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(out.shape)
    loss = (out * pl.Tensor(weights, DEV)).sum()
    loss.backward()
    for t in inputs:
        if not isinstance(t, pl.Tensor) or not t.requires_grad:
            continue
        num = np.zeros_like(t.data)
        flat, nflat = t.data.reshape(-1), num.reshape(-1)
        for i in range(flat.size):
            old = flat[i]
            flat[i] = old + eps
            with pl.without_autodiff():
                fp = float((fn(*inputs).numpy() * weights).sum())
            flat[i] = old - eps
            with pl.without_autodiff():
                fm = float((fn(*inputs).numpy() * weights).sum())
            flat[i] = old
            nflat[i] = (fp - fm) / (2 * eps)
        assert t.grad is not None, "no gradient reached an input that requires grad"
        np.testing.assert_allclose(t.grad.numpy(), num, rtol=rtol, atol=atol)
        t.grad = None


@contextlib.contextmanager
def traced():
    """`with traced() as peak:` — peak[0] is the most the block held at once beyond what was
    allocated before it, whether or not tracemalloc was already tracing (the memory tracker and
    the measured runs start it too)."""
    was = tracemalloc.is_tracing()
    if not was:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    peak = [0]
    try:
        yield peak
    finally:
        peak[0] = tracemalloc.get_traced_memory()[1] - before
        if not was:
            tracemalloc.stop()
