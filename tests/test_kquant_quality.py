"""Quantizing to the K-quants Q2_K ... Q6_K and IQ4_NL / IQ4_XS (quant/kquant_encode.py,
iquant_encode.py) against llama.cpp's own quantizer, called through ggml_quantize_chunk in the
libggml that llama-cpp-python ships: per-tensor RMSE within 2% of llama.cpp's on the same float
tensors, nearly its bytes (the same searches; the numpy reference's float32 sums in another
order part near-ties, the compiled searches of packlora.kernels sum in ggml's), and bytes that
gguf.quants decodes to the values packlora's decoder gives."""
import ctypes
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
from packlora import kernels
from packlora.quant import quantize

KQUANTS = {f"q{b}_k": gguf.GGMLQuantizationType[f"Q{b}_K"] for b in range(2, 7)}
TYPES = {**KQUANTS, "iq4_nl": gguf.GGMLQuantizationType.IQ4_NL,
         "iq4_xs": gguf.GGMLQuantizationType.IQ4_XS}


def _ggml():
    """llama-cpp-python's libggml-base with ggml_quantize_chunk's signature, or a skip."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None:
        pytest.skip("llama-cpp-python is not installed (scripts/test.sh builds it once)")
    found = sorted(Path(spec.submodule_search_locations[0]).rglob("libggml-base.so*"))
    if not found:
        pytest.skip("llama-cpp-python ships no libggml-base here")
    lib = ctypes.CDLL(str(found[0]))
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return fn


def llama_cpp_quantize(fn, x, qtype):
    """llama.cpp's bytes of float32 rows x (N, K) in ggml type qtype, no importance matrix."""
    x = np.ascontiguousarray(x, np.float32)
    elems, nbytes = gguf.constants.GGML_QUANT_SIZES[qtype]
    out = np.zeros((x.shape[0], x.shape[1] // elems * nbytes), np.uint8)
    size = fn(int(qtype), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None)
    assert size == out.nbytes
    return out


def _tensors(rng):
    """Float tensors shaped like weights: Gaussian, heavy-tailed, with outlier rows and zeros."""
    gauss = rng.standard_normal((48, 1024)).astype(np.float32) * 0.02
    heavy = (rng.standard_t(3, (32, 768)) * 0.05).astype(np.float32)
    rows = rng.standard_normal((16, 512)).astype(np.float32) * np.geomspace(1e-3, 10, 16)[:, None]
    rows[3, 256:] = 0.0                                  # a whole zero super-block
    shifted = (rng.random((16, 256)) + 0.5).astype(np.float32)  # all positive: min is 0
    return {"gauss": gauss, "heavy": heavy, "rows": rows.astype(np.float32), "shifted": shifted}


# the numpy reference and the compiled searches (kernels.quantize) for every type
CASES = [(f, q) for q in ("reference", "compiled") for f in sorted(TYPES)]


def _bytes_equal_at_least(fmt, quantizer):
    """The share of llama.cpp's bytes each quantizer reaches on every tensor kind."""
    if quantizer == "compiled":     # ggml's sums, in ggml's order: all but a few near ties
        return 0.998
    # Q2_K weighs absolute errors: grids of exactly equal error are common, and float32 sums in
    # another order pick another of them (2% of the heavy-tailed tensor's bytes)
    return 0.97 if fmt == "q2_k" else 0.99


@pytest.mark.parametrize("fmt, quantizer", CASES)
def test_rmse_within_two_percent_of_llama_cpp(fmt, quantizer):
    fn = _ggml()
    run = kernels.quantize if quantizer == "compiled" else quantize
    for name, x in _tensors(np.random.default_rng(11)).items():
        pw = run(x, fmt, name=name)
        ours = pw.dequantize()
        np.testing.assert_array_equal(gguf.quants.dequantize(pw.buffers["blocks"], TYPES[fmt]),
                                      ours)
        raw = llama_cpp_quantize(fn, x, TYPES[fmt])
        theirs = gguf.quants.dequantize(raw, TYPES[fmt])
        rmse, ref = (float(np.sqrt(((v - x) ** 2).mean())) for v in (ours, theirs))
        assert rmse <= 1.02 * ref + 1e-12, f"{fmt} {name}: rmse {rmse:.3e} vs llama.cpp {ref:.3e}"
        assert (pw.buffers["blocks"] == raw).mean() >= _bytes_equal_at_least(fmt, quantizer), \
            (fmt, name)


@pytest.mark.parametrize("fmt", sorted(KQUANTS))
def test_kquants_round_trip_without_llama_cpp(fmt):
    """Always run: zeros stay zeros, the error beats the legacy format of as many bits (Q4_0,
    Q5_1, Q8_0 halved), ragged K refused."""
    x = np.random.default_rng(3).standard_normal((5, 512)).astype(np.float32)
    x[2] = 0.0

    def rmse(f):
        return float(np.sqrt(((quantize(x, f).dequantize() - x) ** 2).mean()))
    assert np.all(quantize(x, fmt).dequantize()[2] == 0)
    # each bit fewer doubles the error: Q2_K and Q3_K are about two and one bits below Q4_0
    legacy = {"q2_k": rmse("q4_0") * 4, "q3_k": rmse("q4_0") * 2, "q4_k": rmse("q4_0"),
              "q5_k": rmse("q5_1"), "q6_k": rmse("q8_0") * 4}[fmt]
    assert rmse(fmt) < legacy
    with pytest.raises(Exception, match="multiple of 256") as err:
        quantize(np.ones((2, 320), np.float32), fmt)
    # the presets built on q3_k / q4_k / q5_k fall back for such rows, the others name theirs
    hint = {"q2_k": "q4_0 takes", "q6_k": "q8_0 takes",
            "q3_k": "presets q3_k_s, q3_k_m, q3_k_l fall back",
            "q4_k": "presets q4_k_s, q4_k_m fall back", "q5_k": "presets q5_k_s, q5_k_m fall back"}
    assert hint[fmt] in str(err.value)
