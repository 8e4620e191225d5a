"""The SIMD row walkers' nibble lookups, each variant against the codebook."""
import numpy as np
import packlora  # noqa: F401  (thread-pool environment before numpy/numba)
import pytest
from llvmlite import binding as llb
from numba import njit
from packlora.kernels.cpu import simd
from packlora.kernels.cpu.ops import pack_args
from packlora.quant import REGISTRY, quantize

from gguf_blocks import random_packed

_FEATS = llb.get_host_cpu_features()


def _usable(variant):
    return variant == "select" or bool(_FEATS.get("avx512f" if variant == "avx512" else variant))


def _row_1(w, kind, variant, cb, g0, sh):
    """Row 1 of w (K = 192) decoded, accumulated into ones at 0.5 and dotted with a random x by
    the walkers of `variant`, its first block at byte cb; flat formats' absmax from block
    g0 >> sh. Returns (decoded, accumulated, dot, x)."""
    dec, dot, axpy = (simd.make_dispatch(op, variant) for op in (simd.DECODE, simd.DOT, simd.AXPY))

    @njit
    def run(pk, out, x, y):
        dec(kind, pk, cb, 6, g0, sh, np.float32(1.0), out, 0)
        axpy(kind, pk, cb, 6, g0, sh, np.float32(0.5), y, 0)
        return dot(kind, pk, cb, 6, g0, sh, np.float32(1.0), x, 0)

    x = np.random.default_rng(1).standard_normal(192).astype(np.float32)
    out, y = np.zeros(192, np.float32), np.ones(192, np.float32)
    return out, y, run(pack_args(w), out, x, y), x


def _check(w, got):
    out, y, dot, x = got
    want = w.dequantize()[1].astype(np.float64)
    np.testing.assert_array_equal(out, want.astype(np.float32))
    np.testing.assert_allclose(y, 1 + 0.5 * want, rtol=1e-6, atol=1e-6)
    assert abs(dot - x @ want) < 1e-5 * np.abs(x).sum() * np.abs(want).max()


@pytest.mark.parametrize("variant", ["avx512", "avx2", "select"])
@pytest.mark.parametrize("fmt,dq", [("nf4", False), ("fp4", False), ("nf4", True)])
def test_lookup_variants_decode_dot_axpy(variant, fmt, dq):
    if not _usable(variant):
        pytest.skip(f"this CPU lacks {variant}")
    w = quantize(np.random.default_rng(0).standard_normal((3, 192)).astype(np.float32), fmt,
                 block_size=64, double_quant=dq)
    # row 1: bytes from 96, chunks from 6, block shift log2(64/32)
    _check(w, _row_1(w, simd.TAB4DQ if dq else simd.TAB4, variant, 96, 6, 1))


@pytest.mark.parametrize("variant", ["avx512", "avx2", "select"])
def test_lookup_variants_iq4(variant):
    """IQ4_NL's table (its int8 values) through every lookup: row 1 starts at block 6."""
    if not _usable(variant):
        pytest.skip(f"this CPU lacks {variant}")
    w = random_packed("iq4_nl", 3, 192, np.random.default_rng(0))
    _check(w, _row_1(w, simd.IQ4_NL, variant, 6 * REGISTRY["iq4_nl"].layout.nbytes, 0, 0))


def test_host_variant_named():
    assert simd.lookup_variant() in ("avx512", "avx2", "select")
