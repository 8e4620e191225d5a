"""Tests of packlora.quant: formats, bit-exact packing, errors, packed sizes and safetensors I/O.

How the bitsandbytes known vectors below were derived (bitsandbytes is not installable here):
bitsandbytes' CUDA kernel kQuantizeBlockwise (csrc/kernels.cu) takes absmax = max|x| over each
block of the flattened tensor, multiplies every x by (1.0f / absmax) in float32 and picks the
4-bit code with the decision trees dQuantizeNF4 / dQuantizeFP4, which step to the upper code
only when x > pivot (strictly). Two codes go in a byte, the first element in the high nibble;
a tail block is quantized over its valid elements, and for an odd count the pad element is a
0.0 in that block (so its nibble is the code of 0: 7 for NF4, 0 for FP4). The vectors use
absmax values that are powers of two, so 1/absmax and x/absmax are exact and every bnb backend
(CUDA with fast-math reciprocals, CPU, torch) must give the same bytes. The expected codes were
worked out by hand from the pivots and are written out as hex. Double quantization
(quantize_4bit(compress_statistics=True)) subtracts the mean of the absmax and quantizes with
quantize_blockwise(blocksize=256) over create_dynamic_map(signed=True); the expected indices
were found by hand in that 256-entry map, whose values are checked against the table that
mistral.rs (mistralrs-quant/src/bitsandbytes/quantize.rs, INT8_CODE) dumped from bitsandbytes.
"""
import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from packlora import Device, QuantError
from packlora.quant import (
    DYNAMIC_MAP,
    FORMATS,
    FP4_CODE,
    NF4_CODE,
    REGISTRY,
    PackedWeight,
    bits_per_weight,
    dequantize_absmax,
    load_packed,
    packed_nbytes,
    quantize,
    save_packed,
)
from packlora.quant.codebooks import FP4_PIVOTS, FP4_RANK_TO_CODE, NF4_PIVOTS


F32 = np.float32
RNG = np.random.default_rng(1234)
NF4_SEQ = [15, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 2   # 32 codes
FP4_SEQ = [3, 0, 1, 2, 4, 5, 6, 7, 11, 9, 10, 12, 13, 14, 15, 3] * 2
TAIL = [-0.25, 0.5, 0.125]   # absmax 0.5: scaled to -0.5, 1.0, 0.25


def _hex(text):
    return np.frombuffer(bytes.fromhex(text), np.uint8)


def _gguf_type(fmt):
    return getattr(GGMLQuantizationType, fmt.upper())


# -- code tables ---------------------------------------------------------------------------------
def test_codebooks_match_bitsandbytes():
    assert NF4_CODE.dtype == F32 and NF4_CODE.shape == (16,)
    assert NF4_CODE[0] == -1.0 and NF4_CODE[7] == 0.0 and NF4_CODE[15] == 1.0
    assert NF4_CODE[8] == F32(0.07958029955625534)
    # dDequantizeFP4Tree's fp4_dequantization_lut, with the sign bit 0b1000
    lut = np.array([0.0, 0.005208333333, 0.66666667, 1.0, 0.33333333, 0.5, 0.16666667, 0.25], F32)
    np.testing.assert_array_equal(FP4_CODE[:8], lut)
    np.testing.assert_array_equal(FP4_CODE[8:], -lut)
    # the NF4 tree pivots are the float32-rounded midpoints of neighbouring codes
    mids = (NF4_CODE[:-1].astype(np.float64) + NF4_CODE[1:]) / 2
    np.testing.assert_array_equal(NF4_PIVOTS, mids.astype(F32))


def test_dynamic_map_matches_dumped_bitsandbytes_table():
    dm = DYNAMIC_MAP
    assert dm.shape == (256,) and dm.dtype == F32 and np.all(np.diff(dm) > 0)
    assert dm[127] == 0.0 and dm[255] == 1.0
    np.testing.assert_array_equal(dm[:127], -dm[128:255][::-1])
    known = {0: -0.992968738079071, 18: -0.7398437261581421, 20: -0.7117187976837158,
             23: -0.6695312261581421, 30: -0.5710937976837158, 34: -0.5148437023162842,
             46: -0.3460937440395355, 47: -0.33203125, 65: -0.09578125923871994,
             72: -0.07609374821186066, 102: -0.006343749817460775, 116: -0.000493750034365803,
             126: -5.500000384017767e-07, 140: 0.0007187500596046448}
    for idx, value in known.items():
        assert dm[idx] == F32(value), idx


# -- NF4 / FP4 known vectors ---------------------------------------------------------------------
def _vector(code, seq, scale):
    return np.concatenate([scale * code[seq], np.array(TAIL, F32)]).astype(F32)  # 35 values


def test_nf4_known_vector_with_tail_and_pad():
    pw = quantize(_vector(NF4_CODE, NF4_SEQ, F32(2.0)), "nf4", block_size=32)
    # block 0: codes NF4_SEQ; tail: -0.5 -> 2, 1.0 -> 15, 0.25 -> 10, pad 0.0 -> 7
    want = _hex("F0123456789ABCDE" * 2 + "2FA7")
    np.testing.assert_array_equal(pw.buffers["codes"], want)
    np.testing.assert_array_equal(pw.buffers["absmax"], np.array([2.0, 0.5], F32))
    deq = pw.dequantize()
    np.testing.assert_array_equal(deq[:32], F32(2.0) * NF4_CODE[NF4_SEQ])
    np.testing.assert_array_equal(deq[32:], F32(0.5) * NF4_CODE[[2, 15, 10]])


def test_fp4_known_vector_with_tail_and_pad():
    pw = quantize(_vector(FP4_CODE, FP4_SEQ, F32(4.0)), "fp4", block_size=32)
    # tail: -0.5 -> 0b1101, 1.0 -> 0b0011, 0.25 -> 0b0111, pad 0.0 -> 0b0000
    want = _hex("30124567B9ACDEF3" * 2 + "D370")
    np.testing.assert_array_equal(pw.buffers["codes"], want)
    np.testing.assert_array_equal(pw.buffers["absmax"], np.array([4.0, 0.5], F32))
    np.testing.assert_array_equal(pw.dequantize()[:32], F32(4.0) * FP4_CODE[FP4_SEQ])


def _unpack(codes, n):
    q = np.stack([codes >> 4, codes & 15], axis=1).ravel()
    return q[:n]


def test_nf4_ties_go_to_the_lower_code():
    # absmax 1.0: x at a pivot stays below it (bnb tests x > pivot), the next float goes above
    up = np.nextafter(NF4_PIVOTS, F32(2))
    x = np.concatenate([[F32(1.0)], np.stack([NF4_PIVOTS, up], 1).ravel()]).astype(F32)
    q = _unpack(quantize(x, "nf4", block_size=32).buffers["codes"], x.size)
    want = [15] + [c for i in range(15) for c in (i, i + 1)]
    np.testing.assert_array_equal(q, want)


def test_fp4_ties_and_sign():
    up = np.nextafter(FP4_PIVOTS, F32(2))
    mags = np.stack([FP4_PIVOTS, up], 1).ravel()
    x = np.concatenate([[F32(1.0)], mags, -mags, [F32(-0.0), F32(0.0)]]).astype(F32)
    q = _unpack(quantize(x, "fp4", block_size=32).buffers["codes"], x.size)
    pos = [int(FP4_RANK_TO_CODE[r]) for i in range(7) for r in (i, i + 1)]
    np.testing.assert_array_equal(q, [3] + pos + [c | 8 for c in pos] + [0, 0])


def test_zero_block_gives_code_zero_like_the_cuda_kernel():
    x = np.zeros(96, F32)
    x[64:] = NF4_CODE[NF4_SEQ]
    pw = quantize(x, "nf4", block_size=32)
    assert not pw.buffers["codes"][:32].any() and pw.buffers["absmax"][1] == 0
    np.testing.assert_array_equal(pw.dequantize()[:64], 0)


def test_double_quant_of_equal_absmax():
    # every block has absmax 1: centered absmax all 0 -> 1/0 -> index 0, scale 0, offset 1
    pw = quantize(np.ones((4, 64), F32), "nf4", block_size=32, double_quant=True)
    np.testing.assert_array_equal(pw.buffers["absmax_q"], 0)
    np.testing.assert_array_equal(pw.buffers["absmax_scale"], [0.0])
    np.testing.assert_array_equal(dequantize_absmax(pw), 1.0)
    np.testing.assert_array_equal(pw.dequantize(), 1.0)


def test_double_quant_known_vector():
    base = NF4_CODE[NF4_SEQ]
    x = np.concatenate([s * base for s in (1, 2, 3, 6)]).astype(F32)   # absmax 1, 2, 3, 6
    pw = quantize(x, "nf4", block_size=32, double_quant=True)
    b = pw.buffers
    assert set(b) == {"codes", "absmax_q", "absmax_code", "absmax_scale", "absmax_offset"}
    # mean 3 -> centered (-2, -1, 0, 3) -> / 3 -> (-0.667, -0.333, 0, 1) -> nearest entries
    # 23 (-0.6695), 47 (-0.3320), 127 (0.0), 255 (1.0) of the dynamic map
    np.testing.assert_array_equal(b["absmax_q"], [23, 47, 127, 255])
    np.testing.assert_array_equal(b["absmax_scale"], [3.0])
    np.testing.assert_array_equal(b["absmax_offset"], [3.0])
    np.testing.assert_array_equal(b["absmax_code"], DYNAMIC_MAP)
    np.testing.assert_array_equal(_unpack(b["codes"], 128), NF4_SEQ * 4)
    want = DYNAMIC_MAP[[23, 47, 127, 255]] * F32(3) + F32(3)
    np.testing.assert_array_equal(dequantize_absmax(pw), want)


def _nearest(y, table):
    d = np.abs(y[..., None] - table)
    order = np.sort(d, axis=-1)
    return d.argmin(-1), (order[..., 1] - order[..., 0]) > 1e-6


@pytest.mark.parametrize("fmt", ["nf4", "fp4"])
def test_random_codes_are_nearest(fmt):
    x = RNG.standard_normal(64 * 40 + 17).astype(F32)
    pw = quantize(x, fmt, block_size=64)
    absmax = pw.buffers["absmax"]
    blocks = np.arange(x.size) // 64
    y = x * (F32(1) / absmax)[blocks]
    table = NF4_CODE if fmt == "nf4" else FP4_CODE
    want, clear = _nearest(y, table)
    got = _unpack(pw.buffers["codes"], x.size)
    if fmt == "fp4":   # +0 and -0 share a value: compare values, not codes
        got, want = table[got], table[want]
    np.testing.assert_array_equal(got[clear], want[clear])
    np.testing.assert_array_equal(absmax, [np.abs(x[i:i + 64]).max() for i in range(0, x.size, 64)])


def test_double_quant_many_blocks():
    x = (RNG.standard_normal(64 * 700) * np.repeat(RNG.uniform(0.1, 3, 700), 64)).astype(F32)
    pw = quantize(x, "fp4", double_quant=True)
    ref = quantize(x, "fp4")
    true = ref.buffers["absmax"]
    b = pw.buffers
    assert b["absmax_scale"].shape == (3,)
    offset = F32(np.mean(true, dtype=np.float64))
    c = true - offset
    scale = np.array([np.abs(c[i:i + 256]).max() for i in range(0, 700, 256)], F32)
    np.testing.assert_array_equal(b["absmax_scale"], scale)
    want, clear = _nearest(c * (F32(1) / scale)[np.arange(700) // 256], DYNAMIC_MAP)
    np.testing.assert_array_equal(b["absmax_q"][clear], want[clear])
    np.testing.assert_allclose(dequantize_absmax(pw), true, atol=0.01 * scale.max())
    np.testing.assert_array_equal(b["codes"], ref.buffers["codes"])


# -- round trips and ragged sizes ----------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 301), (7, 33), (3, 5, 31), (129,)])
@pytest.mark.parametrize("fmt,dq", [("nf4", False), ("nf4", True), ("fp4", True), ("int8", False)])
def test_blockwise_round_trip_ragged(fmt, dq, shape):
    x = RNG.standard_normal(shape).astype(F32)
    pw = quantize(x, fmt, block_size=32, double_quant=dq, name="w")
    out = pw.dequantize()
    assert out.shape == x.shape and out.dtype == F32
    absmax = dequantize_absmax(pw)[np.arange(x.size) // 32].reshape(shape)
    # half the widest gap between neighbouring codes (times absmax), plus the dq error
    table = {"nf4": NF4_CODE, "fp4": FP4_CODE, "int8": np.arange(-127, 128) / 127}[fmt]
    bound = np.diff(np.sort(table)).max() / 2 * (1 + 1e-5)
    assert np.all(np.abs(out - x) <= bound * absmax * (1.02 if dq else 1.0) + 1e-7)
    assert pw.nbytes == packed_nbytes(fmt, shape, 32, dq)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_gguf_bit_exact_against_gguf_quants(fmt):
    x = RNG.standard_normal((9, 96)).astype(F32)
    x[1] = 0.0                                   # zero row: d = 0
    x[2] = 0.75                                  # constant row
    x[3, :32] = np.linspace(-4, 1, 32)           # largest magnitude negative
    x[4] *= 1e-3
    pw = quantize(x, fmt, name="blk.0.w")
    ref = gguf.quants.quantize(x, _gguf_type(fmt))
    np.testing.assert_array_equal(pw.buffers["blocks"], ref)
    np.testing.assert_array_equal(pw.dequantize(), gguf.quants.dequantize(ref, _gguf_type(fmt)))
    bound = {"q4_0": 1 / 8, "q4_1": 1 / 15, "q8_0": 1 / 127}[fmt]
    amax = np.abs(x.reshape(9, 3, 32)).max(-1, keepdims=True)
    err = np.abs(pw.dequantize() - x).reshape(9, 3, 32)
    assert np.all(err <= amax * bound + 1e-3 * amax + 1e-12)


def test_gguf_known_q8_0_and_q4_0_bytes():
    x = np.arange(-16, 16, dtype=F32)[None, :]     # amax 16 (at element 0, negative)
    q8 = quantize(x, "q8_0").buffers["blocks"][0]
    assert q8[:2].view("<f2")[0] == np.float16(F32(16) / F32(127))
    assert q8[2:].view(np.int8)[0] == -127 and q8[2:].view(np.int8)[16] == 0
    q4 = quantize(x, "q4_0").buffers["blocks"][0]
    assert q4[:2].view("<f2")[0] == np.float16(2.0)         # d = max / -8 = -16 / -8
    # q = trunc(x / d + 8.5), clamped to 15; byte j: element j low, element j + 16 high
    # byte 0: x=-16 -> 0, x=0 -> 8; byte 15: x=-1 -> 8, x=15 -> 16 -> 15
    assert q4[2] == 0x80 and q4[17] == 0xF8
    np.testing.assert_array_equal(q4[2:] & 15, np.trunc(np.arange(-16, 0) / 2 + 8.5))


def test_float64_and_float16_inputs():
    x = RNG.standard_normal((4, 64))
    for dtype in (np.float64, np.float16):
        for fmt in ("nf4", "q4_1"):
            got = quantize(x.astype(dtype), fmt).buffers
            want = quantize(x.astype(dtype).astype(F32), fmt).buffers
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])


# -- sizes -----------------------------------------------------------------------------------------
def test_packed_nbytes_equals_nbytes_everywhere():
    for fmt in FORMATS:
        for dq in ((False, True) if fmt in ("nf4", "fp4") else (False,)):
            for bs in (None,) if REGISTRY[fmt].fixed_block else (None, 32, 128, 4096):
                wide = REGISTRY[fmt].default_block_size == 256  # rows of super-blocks
                for shape in ((33, 256), (1, 512), (5, 4352)) if wide else (
                        (33, 64), (1, 96), (5, 4128)):
                    x = RNG.standard_normal(shape).astype(F32)
                    pw = quantize(x, fmt, block_size=bs, double_quant=dq)
                    assert pw.nbytes == packed_nbytes(fmt, shape, bs, dq), (fmt, bs, dq, shape)


def test_bits_per_weight():
    assert bits_per_weight("nf4", 64, False) == 4.5
    assert round(bits_per_weight("nf4", 64, True), 3) == 4.127
    assert bits_per_weight("q4_1", None, False) == 5.0
    assert bits_per_weight("q8_0", 32, False) == 8.5
    assert bits_per_weight("q4_0", None, False) == 4.5
    assert bits_per_weight("int8", 64, False) == 8.5


# -- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rejected_with_name(fmt, bad):
    x = RNG.standard_normal((2, 64)).astype(F32)
    x[1, 5] = bad
    with pytest.raises(QuantError, match=r"layers\.3\.mlp\.up_proj"):
        quantize(x, fmt, name="layers.3.mlp.up_proj")


def test_float64_overflow_is_non_finite():
    with pytest.raises(QuantError, match="big"):
        quantize(np.full((1, 32), 1e300), "nf4", name="big")


def test_bad_inputs_rejected():
    x = np.ones((4, 64), F32)
    with pytest.raises(QuantError, match="multiple of 32"):
        quantize(np.ones((4, 40), F32), "q4_0", name="w")
    with pytest.raises(QuantError, match="multiple of 256; .*; iq4_nl takes such rows"):
        quantize(np.ones((4, 320), F32), "iq4_xs", name="w")
    with pytest.raises(QuantError, match="2-D"):
        quantize(np.ones(64, F32), "q8_0", name="w")
    with pytest.raises(QuantError, match="block_size 48"):
        quantize(x, "nf4", block_size=48)
    with pytest.raises(QuantError, match="blocks of 32"):
        quantize(x, "q4_0", block_size=64)
    with pytest.raises(QuantError, match="double quantization"):
        quantize(x, "int8", double_quant=True)
    with pytest.raises(QuantError, match="dtype int32"):
        quantize(np.ones((4, 64), np.int32), "nf4", name="w")
    with pytest.raises(QuantError, match="empty"):
        quantize(np.ones((0, 64), F32), "nf4", name="w")
    with pytest.raises(QuantError, match="absmax"):
        PackedWeight("nf4", (4, 64), {"codes": np.zeros(128, np.uint8)}, 64)


# -- GGUF wrapping, devices ------------------------------------------------------------
def test_from_gguf_wraps_memmap_without_copy(tmp_path):
    x = RNG.standard_normal((6, 64)).astype(F32)
    raw = gguf.quants.quantize(x, GGMLQuantizationType.Q4_1)
    path = tmp_path / "raw.bin"
    path.write_bytes(raw.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r")             # flat, read-only
    pw = PackedWeight.from_gguf("Q4_1", (6, 64), mm)
    assert np.shares_memory(pw.buffers["blocks"], mm) and pw.buffers["blocks"].shape == (6, 40)
    want = gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(pw.dequantize(), want)
    pw2 = PackedWeight.from_gguf(GGMLQuantizationType.Q4_1, (6, 64), raw)
    assert np.shares_memory(pw2.buffers["blocks"], raw)
    with pytest.raises(QuantError, match="IQ2_XS.*Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q2_K"):
        PackedWeight.from_gguf("IQ2_XS", (6, 256), raw)
    with pytest.raises(QuantError, match="bytes"):
        PackedWeight.from_gguf("Q8_0", (6, 64), raw)


def test_to_device_tracks_base_packed():
    dev = Device.cpu()
    pw = quantize(RNG.standard_normal((8, 64)).astype(F32), "nf4", double_quant=True)
    before = dev.memory.current["base_packed"]
    moved = pw.to_device(dev)
    assert moved.xp is np and dev.memory.current["base_packed"] - before == pw.nbytes
    np.testing.assert_array_equal(moved.dequantize(), pw.dequantize())
    assert "nf4" in repr(moved) and "double_quant" in repr(moved)


# -- safetensors I/O ------------------------------------------------------------
def test_save_load_round_trip(tmp_path):
    x = RNG.standard_normal((8, 256)).astype(F32)
    tensors = {f"w.{fmt}": quantize(x, fmt) for fmt in FORMATS}
    tensors["w.nf4dq"] = quantize(x, "nf4", block_size=128, double_quant=True)
    tensors["norm"] = np.arange(5, dtype=F32)
    path = tmp_path / "model.safetensors"
    save_packed(path, tensors, metadata={"base_model": "tiny"})
    loaded, meta = load_packed(path)
    assert meta == {"base_model": "tiny"} and set(loaded) == set(tensors)
    np.testing.assert_array_equal(loaded["norm"], tensors["norm"])
    for name, pw in tensors.items():
        if isinstance(pw, PackedWeight):
            got = loaded[name]
            assert (got.format, got.shape, got.block_size, got.double_quant) == \
                   (pw.format, pw.shape, pw.block_size, pw.double_quant)
            for key in pw.buffers:
                np.testing.assert_array_equal(got.buffers[key], pw.buffers[key])
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]   # no temp left


def test_truncated_or_corrupt_file_names_the_file(tmp_path):
    path = tmp_path / "adapter.safetensors"
    save_packed(path, {"w": quantize(np.ones((4, 64), F32), "nf4")})
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 7])
    with pytest.raises(QuantError, match="adapter.safetensors"):
        load_packed(path)
    path.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(QuantError, match="adapter.safetensors"):
        load_packed(path)
    with pytest.raises(QuantError, match="missing.safetensors"):
        load_packed(tmp_path / "missing.safetensors")


@pytest.mark.gpu
def test_cuda_buffers_when_a_gpu_is_present():
    from packlora import DeviceError
    try:
        dev = Device.cuda()
    except DeviceError:
        pytest.skip("no CUDA device here")
    x = RNG.standard_normal((8, 96)).astype(F32)
    pw = quantize(x, "fp4", block_size=32, double_quant=True)
    moved = pw.to_device(dev)
    assert moved.xp is dev.xp and moved.nbytes == pw.nbytes
    np.testing.assert_array_equal(moved.dequantize(), pw.dequantize())
    np.testing.assert_array_equal(dequantize_absmax(moved).get(), dequantize_absmax(pw))
