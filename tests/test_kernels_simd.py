"""The SIMD row walkers' nibble lookups, each variant against the codebook."""
import numpy as np
import packlora  # noqa: F401  (thread-pool environment before numpy/numba)
import pytest
from llvmlite import binding as llb
from numba import njit
from packlora.kernels.cpu import simd
from packlora.kernels.cpu.ops import pack_args
from packlora.quant import quantize

_FEATS = llb.get_host_cpu_features()


def _usable(variant):
    return variant == "select" or bool(_FEATS.get("avx512f" if variant == "avx512" else variant))


@pytest.mark.parametrize("variant", ["avx512", "avx2", "select"])
@pytest.mark.parametrize("fmt,dq", [("nf4", False), ("fp4", False), ("nf4", True)])
def test_lookup_variants_decode_dot_axpy(variant, fmt, dq):
    if not _usable(variant):
        pytest.skip(f"this CPU lacks {variant}")
    w = quantize(np.random.default_rng(0).standard_normal((3, 192)).astype(np.float32), fmt,
                 block_size=64, double_quant=dq)
    pk = pack_args(w)
    kind = simd.TAB4DQ if dq else simd.TAB4
    dec, dot, axpy = (simd.make_dispatch(op, variant) for op in (simd.DECODE, simd.DOT, simd.AXPY))

    @njit
    def run(pk, out, x, y):  # row 1: bytes from 96, chunks from 6, block shift log2(64/32)
        dec(kind, pk, 96, 6, 6, 1, np.float32(1.0), out, 0)
        axpy(kind, pk, 96, 6, 6, 1, np.float32(0.5), y, 0)
        return dot(kind, pk, 96, 6, 6, 1, np.float32(1.0), x, 0)

    want = w.dequantize()[1].astype(np.float64)
    x = np.random.default_rng(1).standard_normal(192).astype(np.float32)
    out, y = np.zeros(192, np.float32), np.ones(192, np.float32)
    got = run(pk, out, x, y)
    np.testing.assert_array_equal(out, want.astype(np.float32))
    np.testing.assert_allclose(y, 1 + 0.5 * want, rtol=1e-6, atol=1e-6)
    assert abs(got - x @ want) < 1e-5 * np.abs(x).sum() * np.abs(want).max()


def test_host_variant_named():
    assert simd.lookup_variant() in ("avx512", "avx2", "select")
