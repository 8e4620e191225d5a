"""LoRA / DoRA adapters: the fused LoraMatmul math and gradients (dropout, DoRA, rsLoRA). Putting
them on a model and the PEFT adapter files: test_apply_lora.py."""
import numpy as np
import pytest
from gradcheck import DEV, check
from packlora import Tensor, ops, without_autodiff
from packlora.adapters import LoraLinear, LoraMatmul
from packlora.nn import Linear, PackedLinear
from packlora.ops.lora import row_norms
from packlora.quant import quantize

M, K, N, R = 5, 64, 48, 4


def _rand(shape, seed, scale=1.0, dtype=np.float32):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def _weight(fmt, seed=0):
    """(base weight for LoraMatmul, its dense float64 value)."""
    w = _rand((N, K), seed, 1 / np.sqrt(K))
    if fmt == "dense":
        return Tensor(w, DEV), w.astype(np.float64)
    pw = quantize(w, fmt, block_size=32 if fmt == "q4_0" else 64, name="w")
    return pw, pw.dequantize().astype(np.float64)


# --- LoraMatmul: forward ---------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["nf4", "q4_0", "dense"])
def test_lora_forward_matches_reference(fmt):
    w, wd = _weight(fmt)
    x, a, b = _rand((2, 3, K), 1), _rand((R, K), 2, 0.1), _rand((N, R), 3, 0.1)
    bias = _rand((N,), 4)
    s = 2.5
    y = LoraMatmul.apply(Tensor(x, DEV), Tensor(a, DEV), Tensor(b, DEV), None, Tensor(bias, DEV),
                         weight=w, scale=s).numpy()
    x64 = x.astype(np.float64)
    want = x64 @ wd.T + s * (x64 @ a.T.astype(np.float64)) @ b.T.astype(np.float64) + bias
    assert y.shape == (2, 3, N)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


# --- LoraMatmul: gradients -------------------------------------------------------------------
def _leaf(shape, seed, scale=1.0):
    return Tensor(_rand(shape, seed, scale, np.float64), DEV).require_grad()


def test_lora_gradcheck_dense_float64_base():
    w = Tensor(_rand((N, 8), 0, 0.3, np.float64), DEV)  # a frozen float64 base
    x, a, b = _leaf((3, 8), 1), _leaf((R, 8), 2, 0.5), _leaf((N, R), 3, 0.5)
    bias = _leaf((N,), 4)
    check(lambda x_, a_, b_, bias_: LoraMatmul.apply(x_, a_, b_, None, bias_, weight=w,
                                                     scale=1.7), [x, a, b, bias])


def test_lora_on_a_swiglu_output_remakes_it():
    """The down projection's LoRA keeps the SwiGLU node, not its (M, F) output, and remakes the
    output in backward: gradients still pass the finite-difference check, and the node saved
    no copy of x."""
    w = Tensor(_rand((N, 8), 0, 0.3, np.float64), DEV)
    gate, up = _leaf((3, 8), 5), _leaf((3, 8), 6)
    a, b = _leaf((R, 8), 2, 0.5), _leaf((N, R), 3, 0.5)

    def mlp_down(g_, u_, a_, b_):
        return LoraMatmul.apply(ops.swiglu(g_, u_), a_, b_, None, None, weight=w, scale=1.7)
    y = mlp_down(gate, up, a, b)
    assert y._fn.x_from is y._fn.parents[0] and y._fn.saved[0] is None
    check(mlp_down, [gate, up, a, b])


@pytest.mark.parametrize("fmt", ["nf4", "q4_0"])
def test_lora_packed_grads_match_dense_reference(fmt):
    w, wd = _weight(fmt)
    s = 0.75
    x = Tensor(_rand((M, K), 1), DEV).require_grad()
    a = Tensor(_rand((R, K), 2, 0.2), DEV).require_grad()
    b = Tensor(_rand((N, R), 3, 0.2), DEV).require_grad()
    g = _rand((M, N), 5)
    y = LoraMatmul.apply(x, a, b, None, None, weight=w, scale=s)
    (y * Tensor(g, DEV)).sum().backward()
    x64, a64, b64, g64 = (t.astype(np.float64) for t in (x.data, a.data, b.data, g))
    np.testing.assert_allclose(x.grad.numpy(), g64 @ wd + s * (g64 @ b64) @ a64,
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(a.grad.numpy(), s * (g64 @ b64).T @ x64, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(b.grad.numpy(), s * g64.T @ (x64 @ a64.T), rtol=1e-4, atol=1e-4)


# --- DoRA ------------------------------------------------------------------------------------
def _dora_layer(fmt, dev):
    w = _rand((N, K), 0, 1 / np.sqrt(K))
    if fmt == "dense":
        base = Linear(Tensor(w, dev))
        wd = w.astype(np.float64)
    else:
        pw = quantize(w, fmt, name="w")
        base, wd = PackedLinear(pw), pw.dequantize().astype(np.float64)
    layer = LoraLinear(base, R, 8.0, use_dora=True)
    layer.lora_A = Tensor(_rand((R, K), 2, 0.2), dev).require_grad()
    layer.lora_B = Tensor(_rand((N, R), 3, 0.2), dev).require_grad()
    layer.init_dora(dev)
    layer.lora_magnitude_vector.data *= 1.0 + 0.3 * _rand((N,), 6)
    return layer, wd


@pytest.mark.parametrize("fmt", ["nf4", "dense"])
def test_dora_forward_and_grads(fmt):
    layer, wd = _dora_layer(fmt, DEV)
    s = layer.scale
    assert s == 2.0
    a64, b64 = layer.lora_A.numpy().astype(np.float64), layer.lora_B.numpy().astype(np.float64)
    m64 = layer.lora_magnitude_vector.numpy().astype(np.float64)
    weff = wd + s * b64 @ a64  # (N, K)
    norm = np.linalg.norm(weff, axis=1)  # per output row
    x = Tensor(_rand((M, K), 1), DEV).require_grad()
    y = layer(x)
    x64 = x.numpy().astype(np.float64)
    np.testing.assert_allclose(y.numpy(), (m64 / norm) * (x64 @ weff.T), rtol=1e-4, atol=1e-4)
    g64 = _rand((M, N), 5).astype(np.float64)
    (y * Tensor(g64.astype(np.float32), DEV)).sum().backward()
    gf = g64 * (m64 / norm)  # the norm is a constant in backward (DoRA paper, PEFT)
    np.testing.assert_allclose(layer.lora_A.grad.numpy(), s * (gf @ b64).T @ x64,
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.lora_B.grad.numpy(), s * gf.T @ (x64 @ a64.T),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.lora_magnitude_vector.grad.numpy(),
                               (g64 * (x64 @ weff.T)).sum(0) / norm, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(x.grad.numpy(), gf @ weff, rtol=1e-4, atol=1e-4)


def test_dora_gradcheck_with_constant_norm():
    w = Tensor(_rand((N, 8), 0, 0.3, np.float64), DEV)
    a, b = _leaf((R, 8), 2, 0.5), _leaf((N, R), 3, 0.5)
    mag = Tensor(np.abs(_rand((N,), 7, 1.0, np.float64)) + 0.5, DEV).require_grad()
    norm = np.linalg.norm(w.data + 1.5 * b.data @ a.data, axis=1)  # fixed, as in backward
    x = _leaf((3, 8), 1)
    check(lambda x_, a_, b_, m_: LoraMatmul.apply(x_, a_, b_, m_, None, weight=w, scale=1.5,
                                                  norm=norm), [x, a, b, mag])


def test_dora_initial_magnitude_is_row_norm_so_output_equals_lora():
    layer, wd = _dora_layer("nf4", DEV)
    norms = row_norms(layer.weight, layer.lora_A.data, layer.lora_B.data, layer.scale, DEV)
    want = np.linalg.norm(wd + layer.scale * layer.lora_B.numpy() @ layer.lora_A.numpy(), axis=1)
    np.testing.assert_allclose(norms, want, rtol=1e-5)


# --- dropout and rsLoRA ----------------------------------------------------------------------
def test_dropout_forward_mask_and_gradients():
    w = Tensor(_rand((N, 8), 0, 0.3, np.float64), DEV)
    a, b = _leaf((R, 8), 2, 0.5), _leaf((N, R), 3, 0.5)
    x64 = _rand((6, 8), 1, 1.0, np.float64)
    p, s = 0.4, 1.3

    def fn(x_, a_, b_):
        DEV.seed(1234)  # the same mask on every call
        return LoraMatmul.apply(x_, a_, b_, None, None, weight=w, scale=s, dropout=p)

    with without_autodiff():
        y = fn(Tensor(x64, DEV), a, b).numpy()
    DEV.seed(1234)
    mask = DEV.rng.random((6, 8), dtype=np.float32) >= p
    assert 0 < mask.sum() < mask.size
    xd = x64 * mask / (1 - p)
    want = x64 @ w.data.T + s * (xd @ a.data.T) @ b.data.T
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    nodrop = x64 @ w.data.T + s * (x64 @ a.data.T) @ b.data.T
    assert np.abs(y - nodrop).max() > 1e-2  # dropout changed the adapter path
    check(fn, [Tensor(x64, DEV).require_grad(), a, b])


def test_dora_with_dropout_is_peft_s_form():
    """PEFT: W x + (f - 1) W drop(x) + f s B A drop(x), f = m / ||W + s B A|| (held constant);
    the shortcut f (W x + s B A drop(x)) is only right without dropout."""
    w = Tensor(_rand((N, 8), 0, 0.3, np.float64), DEV)
    a, b = _leaf((R, 8), 2, 0.5), _leaf((N, R), 3, 0.5)
    mag = Tensor(np.abs(_rand((N,), 7, 1.0, np.float64)) + 0.5, DEV).require_grad()
    bias = _leaf((N,), 8, 0.5)
    x64 = _rand((6, 8), 1, 1.0, np.float64)
    p, s = 0.4, 1.3
    norm = np.linalg.norm(w.data + s * b.data @ a.data, axis=1)

    def fn(x_, a_, b_, m_, bias_):
        DEV.seed(99)  # the same mask on every call
        return LoraMatmul.apply(x_, a_, b_, m_, bias_, weight=w, scale=s, dropout=p, norm=norm)

    with without_autodiff():
        y = fn(Tensor(x64, DEV), a, b, mag, bias).numpy()
    DEV.seed(99)
    xd = x64 * (DEV.rng.random((6, 8), dtype=np.float32) >= p) * np.float32(1 / (1 - p))
    f = mag.data / norm
    wx, wxd = x64 @ w.data.T, xd @ w.data.T
    lora = s * (xd @ a.data.T) @ b.data.T  # (6, N)
    want = wx + (f - 1) * wxd + f * lora + bias.data
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-7)  # the op's scalars are float32
    shortcut = f * (wx + lora) + bias.data
    assert np.abs(y - shortcut).max() > 1e-2
    check(fn, [Tensor(x64, DEV).require_grad(), a, b, mag, bias])


def test_dropout_off_in_eval_mode():
    base = Linear(Tensor(_rand((N, K), 0, 0.1), DEV))
    layer = LoraLinear(base, R, 8.0, dropout=0.5)
    layer.lora_A = Tensor(_rand((R, K), 2, 0.2), DEV).require_grad()
    layer.lora_B = Tensor(_rand((N, R), 3, 0.2), DEV).require_grad()
    x = Tensor(_rand((M, K), 1), DEV)
    layer.eval()
    y1, y2 = layer(x).numpy(), layer(x).numpy()
    np.testing.assert_array_equal(y1, y2)
    layer.train()
    assert np.abs(layer(x).numpy() - y1).max() > 1e-3


def test_rslora_scale():
    base = Linear(Tensor(_rand((N, K), 0), DEV))
    assert LoraLinear(base, 16, 8.0, use_rslora=True).scale == pytest.approx(8.0 / 4.0)
    assert LoraLinear(base, 16, 8.0).scale == pytest.approx(0.5)
