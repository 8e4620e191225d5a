"""CPU elementwise and row kernels (fast exp, SwiGLU, RMSNorm, RoPE, cross-entropy rows,
attention's softmax rows) against numpy in float64, on both sides of the serial / parallel
split."""
import importlib
import pkgutil

import numpy as np
import packlora  # noqa: F401  (thread-pool environment before numpy/numba)
import packlora.kernels.cpu as cpu_kernels
import pytest
from numba import njit
from numba.core.registry import CPUDispatcher as Dispatcher
from packlora.kernels.cpu import SERIAL_MAX
from packlora.kernels.cpu import attention as att
from packlora.kernels.cpu import elementwise as ew
from packlora.kernels.cpu.fastexp import SAFE_FASTMATH, fexp
from packlora.kernels.cpu.softmax_ce import ce_grad_rows, ce_rows


@njit(fastmath=SAFE_FASTMATH)
def _fexp_each(a, out):
    for i in range(a.shape[0]):
        out[i] = fexp(a[i])


def test_fast_exp_float32_accuracy_and_edges():
    x = np.linspace(-87.0, 88.5, 200001, dtype=np.float32)
    out = np.empty_like(x)
    _fexp_each(x, out)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - ref) / ref) < 1e-6
    edge = np.array([np.nan, -np.inf, np.inf, -100.0, 100.0, 0.0], np.float32)
    out = np.empty_like(edge)
    _fexp_each(edge, out)
    assert np.isnan(out[0]) and out[1] == 0.0 and out[2] == np.inf
    assert out[3] == 0.0 and out[4] == np.inf and out[5] == 1.0
    x64, out64 = np.array([1.5, -3.0]), np.empty(2)
    _fexp_each(x64, out64)
    np.testing.assert_array_equal(out64, np.exp(x64))  # float64 keeps libm's exp


def test_fused_float32_elementwise_match_float64():
    """SwiGLU, cross-entropy rows and the attention passes in float32 (fast exp) agree with
    their float64 results."""
    rng = np.random.default_rng(5)
    gate, up, g = (rng.standard_normal((7, 45)) * 4 for _ in range(3))
    for dt, tol in ((np.float64, 0.0), (np.float32, 2e-6)):
        y = np.empty(gate.shape, dt)
        ew.swiglu_fwd(gate.astype(dt), up.astype(dt), y)
        dg, du = np.empty(gate.shape, dt), np.empty(gate.shape, dt)
        ew.swiglu_bwd(g.astype(dt), gate.astype(dt), up.astype(dt), dg, du, True, True)
        s = 1 / (1 + np.exp(-gate))
        for got, ref in ((y, gate * s * up), (dg, g * up * s * (1 + gate * (1 - s))),
                         (du, g * gate * s)):
            assert np.max(np.abs(got - ref)) <= tol * np.abs(ref).max() + 1e-12
    z = rng.standard_normal((5, 300)) * 6
    t = np.array([3, -100, 299, 0, 17])
    lse, nll = np.empty(5, np.float32), np.empty(5, np.float32)
    ce_rows(z.astype(np.float32), t, -100, lse, nll)
    ref_lse = np.log(np.exp(z).sum(1))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
    zg = z.astype(np.float32)
    ce_grad_rows(zg, t, -100, lse, 0.5)
    ref = np.exp(z - ref_lse[:, None]) * 0.5
    ref[np.arange(5), np.where(t < 0, 0, t)] -= np.where(t < 0, 0, 0.5)
    ref[1] = 0
    np.testing.assert_allclose(zg, ref, atol=1e-6)
    s = (rng.standard_normal((6, 40)) * 5).astype(np.float32)
    s[:, 30:] = -np.inf
    p, lse = s.copy(), np.empty(6, np.float32)
    att.softmax_rows(p, lse, np.float32(1.0), att.NO_CAUSAL)
    s64 = s.astype(np.float64)
    ref = np.exp(s64 - s64.max(1, keepdims=True))
    np.testing.assert_allclose(p, ref / ref.sum(1, keepdims=True), atol=1e-7)
    assert np.all(p[:, 30:] == 0)
    np.testing.assert_allclose(lse, np.log(np.exp(s64).sum(1)), rtol=1e-6)
    s[2, 7] = np.nan  # a NaN score makes its whole row NaN, wherever it sits
    s[4, 0] = np.nan
    att.softmax_rows(s, lse, np.float32(1.0), att.NO_CAUSAL)
    assert np.isnan(s[[2, 4], :30]).all() and np.isnan(lse[[2, 4]]).all()
    assert not np.isnan(s[[0, 1, 3, 5]]).any()


@pytest.mark.parametrize("r0,groups,shift", [(0, 1, 0), (6, 3, 0), (4, 2, 5), (0, 2, -1)])
def test_attention_row_kernels_apply_the_causal_limit(r0, groups, shift):
    """softmax_rows and probs_t with `causal` give what the scores masked with -inf give: row i
    of a slice of `rows` sees keys <= (r0 + i % rows) // groups + shift (none: a zero row)."""
    rng = np.random.default_rng(13)
    rows, keys, scale = 5, 11, 0.37
    s = (rng.standard_normal((3 * rows, keys)) * 4).astype(np.float32)  # three slices
    pos = (r0 + np.arange(3 * rows) % rows) // groups + shift
    hidden = np.arange(keys)[None, :] > pos[:, None]
    p, lse = s.copy(), np.empty(3 * rows, np.float32)
    att.softmax_rows(p, lse, np.float32(scale), (rows, r0, groups, shift))
    z = np.where(hidden, -np.inf, s.astype(np.float64) * scale)
    seen = ~hidden.all(1)
    ref_lse = np.log(np.exp(z[seen]).sum(1))
    np.testing.assert_allclose(lse[seen], ref_lse, rtol=1e-6)
    np.testing.assert_allclose(p[seen], np.exp(z[seen] - ref_lse[:, None]), atol=1e-6)
    assert np.all(p[hidden] == 0)
    # transposed (keys x queries), one slice: p <- exp(p * scale - lse), hidden keys 0
    pt = s[:rows].T.copy()[None]  # (1, keys, rows)
    lse_t = rng.standard_normal((1, rows)).astype(np.float32)
    att.probs_t(pt, np.float32(scale), lse_t, (rows, r0, groups, shift))
    want = np.exp(s[:rows].T.astype(np.float64) * scale - lse_t[0][None, :])
    want[hidden[:rows].T] = 0.0
    np.testing.assert_allclose(pt[0], want, rtol=2e-6, atol=1e-30)
    assert np.all(pt[0][hidden[:rows].T] == 0)


@pytest.mark.parametrize("rows", [3, 400])  # under and over SERIAL_MAX elements (one thread / all)
def test_row_kernels_serial_and_parallel_branches(rows):
    d = 576
    assert (rows * d < SERIAL_MAX) == (rows == 3)
    rng = np.random.default_rng(9)
    x, up = (rng.standard_normal((rows, d)) for _ in range(2))
    w = rng.standard_normal(d)
    y, r = np.empty((rows, d)), np.empty(rows)
    ew.rmsnorm_fwd(x, w, 1e-5, y, r)
    np.testing.assert_allclose(y, x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-5) * w,
                               rtol=1e-12)
    ew.swiglu_fwd(x, up, y)
    np.testing.assert_allclose(y, x / (1 + np.exp(-x)) * up, rtol=1e-12)
    s, lse = x.copy(), np.empty(rows)
    att.softmax_rows(s, lse, 1.0, att.NO_CAUSAL)
    np.testing.assert_allclose(lse, np.log(np.exp(x).sum(1)), rtol=1e-12)
    np.testing.assert_allclose(s, np.exp(x - lse[:, None]), rtol=1e-12)
    xr = x.reshape(1, rows, 9, 64)
    ang = rng.standard_normal((rows, 32))
    out = np.empty_like(xr)
    ew.rope_apply(xr, np.cos(ang), np.sin(ang), out, 1.0)
    x1, x2 = xr[..., :32], xr[..., 32:]
    c, sn = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    np.testing.assert_allclose(out, np.concatenate([x1 * c - x2 * sn, x2 * c + x1 * sn], -1),
                               rtol=1e-12, atol=1e-12)


def test_cross_entropy_rows_on_a_vocabulary_row_and_nan():
    """A row the length of a vocabulary (not a multiple of any vector width) against float64;
    a NaN logit makes its row's log-sum-exp NaN, wherever it sits."""
    rng = np.random.default_rng(11)
    z = (rng.standard_normal((3, 49157)) * 8).astype(np.float32)
    z[1, 49156] = 60.0  # the largest logit in the last, ragged lane
    t = np.array([5, 49156, 0])
    lse, nll = np.empty(3, np.float32), np.empty(3, np.float32)
    ce_rows(z, t, -100, lse, nll)
    z64 = z.astype(np.float64)
    ref = z64.max(1) + np.log(np.exp(z64 - z64.max(1, keepdims=True)).sum(1))
    np.testing.assert_allclose(lse, ref, rtol=1e-6)
    np.testing.assert_allclose(nll, ref - z64[np.arange(3), t], rtol=1e-5, atol=1e-6)
    z[0, 0], z[2, 30001] = np.nan, np.nan
    ce_rows(z, t, -100, lse, nll)
    assert np.isnan(lse[[0, 2]]).all() and np.isfinite(lse[1])


def test_every_cpu_kernel_takes_numpys_error_model():
    """Numba's default error model checks divisions in the loop and keeps LLVM from vectorizing
    it (kernels/cpu/__init__.py); every compiled kernel is declared through `kernel`."""
    found = 0
    for module in pkgutil.iter_modules(cpu_kernels.__path__):
        mod = importlib.import_module(f"{cpu_kernels.__name__}.{module.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, Dispatcher) and obj.py_func.__module__ == mod.__name__:
                found += 1
                assert obj.targetoptions.get("error_model") == "numpy", f"{mod.__name__}.{name}"
                assert obj._cache.__class__.__name__ != "NullCache", f"{mod.__name__}.{name}"
    assert found > 40
