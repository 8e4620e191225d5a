"""The compiled K-quant and IQ4 searches (kernels/cpu/kquant_search.py, iq4_search.py) against
their numpy references (quant/kquant_encode.py, iquant_encode.py): the same codes, scales and
mins on nearly every sub-block, the same
weighted error on average where a near tie went the other way (float32 sums in another order),
all-zero and flat sub-blocks exactly as the reference. The bytes against llama.cpp's are
tests/test_kquant_quality.py's."""
import numpy as np
import pytest
from packlora.kernels.cpu import iq4_search
from packlora.kernels.cpu import kquant_search as compiled
from packlora.quant import iquant_encode
from packlora.quant import kquant_encode as reference
from packlora.quant.codebooks import IQ4_CODE

# (nmax, rmin, nstep, mad) of Q4_K, Q5_K and Q2_K, with their sub-block lengths
SCALE_MIN = {"q4_k": (32, 15, -1.0, 20, False), "q5_k": (32, 31, -0.5, 15, False),
             "q2_k": (16, 3, -0.5, 15, True)}


def _blocks(rng, s, n):
    """s sub-blocks of n: Gaussian at spread scales, with zero, flat, positive and outlier ones."""
    x = rng.standard_normal((s, n)).astype(np.float32) * np.geomspace(1e-4, 10, s)[:, None]
    x = x.astype(np.float32)
    x[::7] = 0.0                                        # all zero
    x[1::11] = np.float32(-0.75)                        # flat and negative
    x[2::13] = np.abs(x[2::13]) + np.float32(0.5)       # all positive: the min clips to 0
    x[3::17, 0] *= np.float32(40)                       # one outlier
    x[4::19] *= np.float32(1e-17)                       # below GROUP_MAX_EPS
    return x


def _as_good(err_ref, err_new):
    """The searches are greedy: where float32 rounding breaks a near tie the other way, the two
    go on to choices of different error, either way round (by up to 7x on nearly flat
    sub-blocks, whose least-squares fits are degenerate). Over all sub-blocks neither is
    better: the geometric mean of the error ratios is within 1% of 1."""
    some = err_ref > 0
    assert np.all(err_new[~some] == 0)
    if some.any():
        assert abs(np.log(err_new[some] / err_ref[some]).mean()) <= np.log(1.01)


def _mostly_close(new, ref, rows):
    """Values of sub-blocks with the same codes: equal but for the rounding of their
    least-squares solve (a difference of products), which a few near-degenerate ones show."""
    if rows.any():
        assert np.isclose(new[rows], ref[rows], rtol=1e-4, atol=1e-30).mean() >= 0.98


@pytest.mark.parametrize("fmt", sorted(SCALE_MIN))
@pytest.mark.parametrize("s", [1, 5, 333])
def test_scale_min_search(fmt, s):
    n, nmax, rmin, nstep, mad = SCALE_MIN[fmt]
    x = _blocks(np.random.default_rng(s), s, n)
    w = np.abs(x) if mad else np.sqrt((x * x).mean(axis=1, keepdims=True)) + np.abs(x)
    results = [f(x, w, nmax, rmin, np.float32(0.1), nstep, mad)
               for f in (reference.fit_scale_min, compiled.fit_scale_min)]
    (s_ref, m_ref, q_ref), (s_new, m_new, q_new) = results
    assert q_new.dtype == np.float32 and q_new.min() >= 0 and q_new.max() <= nmax
    same = (q_ref == q_new).all(axis=1)
    assert same.mean() >= 0.98
    # a grid of one code throughout has a least-squares determinant of 0 up to rounding: whether
    # it refits the scale at all is the sums' rounding
    fit = same & (q_new.min(axis=1) < q_new.max(axis=1))
    _mostly_close(s_new, s_ref, fit)
    _mostly_close(m_new, m_ref, fit)
    flat = x.max(axis=1) == np.minimum(x.min(axis=1), 0)
    assert np.all(s_new[flat] == 0) and np.all(q_new[flat] == 0)

    def error(scale, mn, q):
        diff = scale[:, None] * q - mn[:, None] - x
        return (w * (np.abs(diff) if mad else diff * diff)).sum(axis=1, dtype=np.float64)
    _as_good(error(s_ref, m_ref, q_ref), error(s_new, m_new, q_new))


@pytest.mark.parametrize("search, nmax, offset", [("fit_q3_scale", 4, 4),
                                                  ("fit_signed_scale", 32, 0)])
@pytest.mark.parametrize("s", [1, 6, 333])
def test_signed_searches(search, nmax, offset, s):
    """Q3_K's code-by-code descent and Q6_K's 19 candidate scales: codes stored with an offset
    (Q3_K) or signed (Q6_K), weights x^2."""
    x = _blocks(np.random.default_rng(100 + s), s, 16)
    (s_ref, q_ref), (s_new, q_new) = (getattr(m, search)(x, nmax) for m in (reference, compiled))
    assert q_new.dtype == np.float32
    assert q_new.min() >= offset - nmax and q_new.max() <= offset + nmax - 1
    same = (q_ref == q_new).all(axis=1)
    assert same.mean() >= 0.95
    _mostly_close(s_new, s_ref, same)
    zero = np.abs(x).max(axis=1) < 1e-15
    assert np.all(s_new[zero] == 0) and np.all(q_new[zero] == 0)

    def error(scale, q):
        return (x * x * (scale[:, None] * (q - offset) - x) ** 2).sum(axis=1, dtype=np.float64)
    _as_good(error(s_ref, q_ref), error(s_new, q_new))


@pytest.mark.parametrize("s", [1, 7, 333])
def test_iq4_scale_search(s):
    """IQ4_NL / IQ4_XS's scale over 15 candidates on the non-uniform table, weights x^2."""
    x = _blocks(np.random.default_rng(200 + s), s, 32)
    d_ref, d_new = iquant_encode.fit_scales(x), iq4_search.fit_scales(x)
    assert d_new.dtype == np.float32 and d_new.shape == (s,)
    zero = np.abs(x).max(axis=1) < 1e-15
    assert np.all(d_new[zero] == 0)

    def error(d):
        inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, d))[:, None].astype(np.float32)
        q = IQ4_CODE[iquant_encode.nearest_code(x * inv)]
        return (x * x * (d[:, None] * q - x) ** 2).sum(axis=1, dtype=np.float64)
    err_ref, err_new = error(d_ref), error(d_new)
    # the same scale, or a tie: a nearly flat sub-block fits as well with a positive scale as
    # with a negative one (the table is not symmetric), and the sums' order picks one
    same = np.isclose(d_new, d_ref, rtol=1e-4, atol=1e-30)
    tie = np.isclose(err_new, err_ref, rtol=1e-6, atol=0)
    assert (same | tie).mean() >= 0.98
    _as_good(err_ref, err_new)
