"""Every op against central finite differences in float64, including broadcasting."""
import importlib

import numpy as np
import packlora as pl
import pytest
from gradcheck import DEV, check, leaf, traced
from packlora import ops
from packlora.kernels import fused_rows
from packlora.ops.head_loss import head_cross_entropy


@pytest.mark.parametrize("sa,sb", [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)),
                                   ((3, 4), ())])
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_broadcast(op, sa, sb):
    a, b = leaf(sa, 1), leaf(sb, 2, positive=(op == "div"))
    f = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y,
         "mul": lambda x, y: x * y, "div": lambda x, y: x / y}[op]
    check(f, [a, b])


def test_scalar_operands_and_unary():
    a = leaf((3, 5), 3, positive=True)
    check(lambda x: 2.0 * x - 1.0 + x / 3.0 - (1.0 / x), [a])
    check(lambda x: -x, [a])
    check(lambda x: x ** 3, [a])
    check(lambda x: x ** 0.5, [a])
    check(lambda x: x.exp(), [leaf((4,), 4)])
    check(lambda x: x.log(), [a])
    check(lambda x: x.sqrt(), [a])


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 2)),
                                   ((2, 1, 3, 4), (3, 4, 2))])
def test_matmul(sa, sb):
    check(lambda x, y: x @ y, [leaf(sa, 5), leaf(sb, 6)])


def test_reductions():
    a = leaf((2, 3, 4), 7)
    check(lambda x: x.sum(), [a])
    check(lambda x: x.sum(axis=1), [a])
    check(lambda x: x.mean(axis=(0, 2)), [a])
    check(lambda x: x.mean(axis=-1, keepdims=True), [a])


def test_shape_ops():
    a = leaf((2, 3, 4), 8)
    check(lambda x: x.reshape(6, 4), [a])
    check(lambda x: x.transpose(2, 0, 1), [a])
    check(lambda x: x.T, [a])
    check(lambda x: x[:, 1:, ::2], [a])
    check(lambda x: x[np.array([0, 1, 1])], [a])  # repeated rows accumulate
    b = leaf((2, 2, 4), 9)
    check(lambda x, y: ops.concat([x, y], axis=1), [a, b])
    check(lambda x: ops.split(x, [1, 3], axis=-1)[1] * 2 + ops.split(x, 2, axis=-1)[0].sum(), [a])


def test_activations():
    a = leaf((3, 7), 10)
    check(ops.silu, [a])
    check(lambda x: ops.softmax(x, axis=-1), [a])
    check(lambda x: ops.softmax(x, axis=0), [a])
    check(ops.swiglu, [a, leaf((3, 7), 11)])


def test_rms_norm():
    check(lambda x, w: ops.rms_norm(x, w, 1e-5), [leaf((2, 3, 8), 12), leaf((8,), 13)])


def test_rope():
    t, d = 5, 8
    pos = np.arange(t)[:, None] * (10000.0 ** (-np.arange(d // 2) / (d // 2)))[None]
    cos, sin = np.cos(pos), np.sin(pos)
    check(lambda x: ops.rope(x, cos, sin), [leaf((2, t, 3, d), 14)])


def test_rope_with_positions_per_row():
    """Packed rows: (B, T, D/2) tables, each row its own positions."""
    d = 8
    positions = np.array([[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]])
    pos = positions[..., None] * (10000.0 ** (-np.arange(d // 2) / (d // 2)))
    cos, sin = np.cos(pos), np.sin(pos)
    x = leaf((2, 5, 3, d), 14)
    check(lambda x: ops.rope(x, cos, sin), [x])
    for b in range(2):  # row b rotated by its own tables is row b of a one-row batch
        one = ops.rope(pl.Tensor(x.data[b:b + 1], DEV), cos[b], sin[b]).numpy()
        np.testing.assert_allclose(ops.rope(x, cos, sin).numpy()[b:b + 1], one, rtol=1e-12)


@pytest.mark.parametrize("chunk", [64, 2])
def test_attention_within_packed_segments(chunk, monkeypatch):
    """segments: each example attends only to itself; the result equals running each example
    on its own, and the gradient is right."""
    monkeypatch.setattr(importlib.import_module("packlora.ops.attention"), "QUERY_CHUNK", chunk)
    seg = np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 2, 2]])
    q, k, v = leaf((2, 6, 4, 3), 15), leaf((2, 6, 2, 3), 16), leaf((2, 6, 2, 3), 17)
    check(lambda q, k, v: ops.attention(q, k, v, segments=seg), [q, k, v])
    out = ops.attention(q, k, v, segments=seg).numpy()
    for b in range(2):
        for sid in np.unique(seg[b]):
            at = np.flatnonzero(seg[b] == sid)
            alone = ops.attention(*(pl.Tensor(x.data[b:b + 1, at], DEV) for x in (q, k, v)))
            np.testing.assert_allclose(out[b, at], alone.numpy()[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [64, 2])
@pytest.mark.parametrize("h,hkv,t,s", [(4, 2, 5, 5), (3, 3, 4, 4), (6, 2, 3, 7)])
def test_attention_gqa(h, hkv, t, s, chunk, monkeypatch):
    """chunk 2: several query blocks, each seeing its own key prefix."""
    monkeypatch.setattr(importlib.import_module("packlora.ops.attention"), "QUERY_CHUNK", chunk)
    q, k, v = leaf((2, t, h, 4), 15), leaf((2, s, hkv, 4), 16), leaf((2, s, hkv, 4), 17)
    check(ops.attention, [q, k, v])


@pytest.mark.parametrize("chunk", [64, 1, 3])
def test_attention_matches_reference(chunk, monkeypatch):
    monkeypatch.setattr(importlib.import_module("packlora.ops.attention"), "QUERY_CHUNK", chunk)
    q, k, v = leaf((1, 4, 4, 3), 18), leaf((1, 4, 2, 3), 19), leaf((1, 4, 2, 3), 20)
    out = ops.attention(q, k, v).numpy()
    kk, vv = np.repeat(k.data, 2, axis=2), np.repeat(v.data, 2, axis=2)
    s = np.einsum("bthd,bshd->bhts", q.data, kk) / np.sqrt(3)
    s = np.where(np.tril(np.ones((4, 4), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, np.einsum("bhts,bshd->bthd", p, vv), rtol=1e-10)


@pytest.mark.parametrize("dt", [np.float64, np.float32])
def test_attention_one_query_without_backward(dt):
    """Decoding's case (T = 1, nothing to differentiate, keys a view of a larger cache, padded
    rows) gives what the recorded path gives."""
    rng = np.random.default_rng(41)
    q = rng.standard_normal((2, 1, 6, 8)).astype(dt)
    cache = [rng.standard_normal((2, 12, 2, 8)).astype(dt) for _ in range(2)]
    k, v = (c[:, :9] for c in cache)  # (B, S, Hkv, D) views, as the KV cache hands them
    valid = np.ones((2, 9), bool)
    valid[1, :4] = False
    for kv in (None, valid):
        got = ops.attention(*(pl.Tensor(a, DEV) for a in (q, k, v)), key_valid=kv).numpy()
        rec = [pl.Tensor(a.copy(), DEV).require_grad() for a in (q, k, v)]
        want = ops.attention(*rec, key_valid=kv)
        assert want._fn is not None  # the recorded, copying path
        f32 = dt == np.float32  # float32: the fused one-query kernel sums in its own order
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5 if f32 else 1e-12,
                                   atol=1e-6 if f32 else 0)


def test_attention_memory_grows_linearly_in_t():
    """The op's peak through forward and backward grows like T, not T^2: its scores and causal
    mask exist one block of queries at a time (a (T*G, T) mask alone would be 16 MiB at 2048)."""
    def peak(t):
        q, k, v = (pl.Tensor(np.random.default_rng(i).standard_normal((1, t, n, 16)).astype(
            np.float32), DEV).require_grad() for i, n in enumerate((8, 2, 2)))
        with traced() as p:
            ops.attention(q, k, v).sum().backward()
        return p[0]
    peak(256)  # first-call allocations
    small, large = peak(1024), peak(2048)
    assert large < 2.3 * small, (small, large)  # measured 2.0x; with the mask kept, 2.7x


@pytest.mark.parametrize("chunk", [2, 256])
def test_head_cross_entropy_only_meets_target_rows(chunk):
    """The fused LM head + loss: the mean NLL over target rows of h @ W.T, gradient by finite
    differences; rows without a target get a zero gradient."""
    h, w = leaf((7, 5), 40), pl.Tensor(np.random.default_rng(41).standard_normal((11, 5)), DEV)
    targets = np.array([3, -100, 0, -100, -100, 10, 4])
    fn = (lambda x: head_cross_entropy(x, w, targets, chunk=chunk))
    z = h.data @ w.data.T
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    keep = targets != -100
    want = (lse[keep] - z[keep, targets[keep]]).mean()
    np.testing.assert_allclose(fn(h).item(), want, rtol=1e-6)  # the loss is float32
    check(fn, [h], eps=1e-3, rtol=1e-3, atol=1e-3)  # the loss is rounded to float32
    fn(h).backward()
    assert not h.grad.numpy()[~keep].any()


@pytest.mark.parametrize("temp_rows", [None, 2])
def test_cross_entropy_chunks_and_ignore(temp_rows, monkeypatch):
    """temp_rows: the array-expression forward (the GPU's) holds exp(z - max) for so many rows
    at a time (chunks of 3 and 4 rows: ragged blocks)."""
    if temp_rows:
        monkeypatch.setattr(fused_rows, "CE_TEMP_BYTES", temp_rows * 11 * 8)
    logits = leaf((2, 5, 11), 21)
    targets = np.array([[1, 2, -100, 4, 10], [0, -100, 3, 3, 7]])
    check(lambda x: ops.cross_entropy(x, targets, chunk=3), [logits])
    lf = logits.data.reshape(-1, 11)
    tf = targets.reshape(-1)
    m = tf != -100
    lse = np.log(np.exp(lf).sum(-1))
    ref = (lse - lf[np.arange(10), np.where(m, tf, 0)])[m].mean()
    assert abs(ops.cross_entropy(logits, targets, chunk=4).item() - ref) < 1e-12


def test_embedding_scatter_add():
    w = leaf((6, 3), 22)
    ids = np.array([[0, 2, 2], [5, 0, 1]])
    check(lambda x: ops.embedding(x, ids), [w])


def test_dropout_uses_device_generator():
    x = pl.Tensor(np.ones((200, 50)), DEV).require_grad()
    DEV.seed(3)
    a = ops.dropout(x, 0.25).numpy()
    DEV.seed(3)
    b = ops.dropout(x, 0.25)
    np.testing.assert_array_equal(a, b.numpy())
    assert abs((a == 0).mean() - 0.25) < 0.02
    assert np.allclose(a[a != 0], 1 / 0.75)
    b.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), a)
    assert ops.dropout(x, 0.25, training=False) is x


def test_attention_backward_in_batch_slices(monkeypatch):
    attn_mod = importlib.import_module("packlora.ops.attention")
    q, k, v = leaf((3, 5, 4, 4), 23), leaf((3, 5, 2, 4), 24), leaf((3, 5, 2, 4), 25)
    ops.attention(q, k, v).sum().backward()
    whole = [t.grad.numpy().copy() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    monkeypatch.setattr(attn_mod, "SCORE_BYTES", 1)  # one batch row per slice
    ops.attention(q, k, v).sum().backward()
    for t, w in zip((q, k, v), whole):
        np.testing.assert_allclose(t.grad.numpy(), w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("key_valid", [False, True])
def test_attention_float32_fused_path_matches_float64(key_valid, monkeypatch):
    """float32 numpy inputs take the Numba softmax kernels; float64 the numpy expressions."""
    monkeypatch.setattr(importlib.import_module("packlora.ops.attention"), "QUERY_CHUNK", 3)
    rng = np.random.default_rng(31)
    arrays = [rng.standard_normal(s) for s in ((2, 7, 4, 8), (2, 9, 2, 8), (2, 9, 2, 8))]
    valid = np.ones((2, 9), bool)
    valid[1, :3] = False  # left padding in the second row
    results = []
    for dt in (np.float64, np.float32):
        q, k, v = (pl.Tensor(a.astype(dt), DEV).require_grad() for a in arrays)
        out = ops.attention(q, k, v, key_valid=valid if key_valid else None)
        (out * pl.Tensor(arrays[0][:, :, :, ::-1].astype(dt).copy(), DEV)).sum().backward()
        results.append([out.numpy()] + [t.grad.numpy() for t in (q, k, v)])
    for a64, a32 in zip(*results):
        assert a32.dtype == np.float32
        np.testing.assert_allclose(a32, a64, rtol=2e-4, atol=2e-5)
