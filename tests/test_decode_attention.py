"""The fused attention of one new position over a KV cache (kernels/cpu/decode_attention.py)
against attention written in numpy float64, grouped heads, left padding, cache views."""
import numpy as np
import packlora  # noqa: F401  (thread-pool environment before numpy/numba)
import pytest
from packlora.kernels import one_query_attention
from packlora.kernels.cpu import decode_attention


def _reference(q, k, v, valid, scale):
    b, h, d = q.shape
    g = h // k.shape[2]
    out = np.empty((b, h, d))
    for i in range(b):
        for j in range(h):
            s = k[i, :, j // g].astype(np.float64) @ q[i, j].astype(np.float64) * scale
            if valid is not None:
                s = np.where(valid[i], s, -np.inf)
            p = np.exp(s - s.max())
            out[i, j] = (p / p.sum()) @ v[i, :, j // g].astype(np.float64)
    return out


@pytest.mark.parametrize("s,padded", [(1, False), (13, True), (13, False), (1050, True)])
def test_one_query_matches_numpy(s, padded):
    """1,050 keys take the parallel branch (2 * k.size >= SERIAL_MAX), the rest the serial."""
    assert (2 * 2 * 1050 * 2 * 16 >= decode_attention.SERIAL_MAX) and 2 * 2 * 13 * 2 * 16 < \
        decode_attention.SERIAL_MAX
    rng = np.random.default_rng(3)
    b, h, kv, d, cap = 2, 6, 2, 16, 1100
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    cache_k = rng.standard_normal((b, cap, kv, d)).astype(np.float32)
    cache_v = rng.standard_normal((b, cap, kv, d)).astype(np.float32)
    k, v = cache_k[:, :s], cache_v[:, :s]  # the cache's views, as decoding passes them
    valid = None
    if padded:
        valid = np.ones((b, s), bool)
        valid[0, : s // 2] = False  # row 0 left-padded; the newest key is always real
    got = one_query_attention(np, q, k, v, valid, 0.25)
    np.testing.assert_allclose(got, _reference(q, k, v, valid, 0.25), rtol=2e-5, atol=2e-5)


def test_one_query_declines_what_it_does_not_take():
    q = np.zeros((1, 2, 4), np.float64)
    k = v = np.zeros((1, 3, 1, 4), np.float64)
    assert one_query_attention(np, q, k, v, None, 1.0) is None
