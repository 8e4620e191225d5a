"""The SIMD walker's chunk model (kernels/cpu/chunks.py) describes layouts beyond "header + 32
values": ggml's 256-value K-quant super-blocks (addressing checked against gguf.quants by a numpy
walk of the model), and a two-chunk Q8_0-like block through the real SIMD codegen."""
import gguf
import numpy as np
import packlora  # noqa: F401  (thread-pool environment before numpy/numba)
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from numba import njit
from packlora.kernels.cpu import simd
from packlora.kernels.cpu.chunks import Chunk, ChunkLayout, chunk_address, kquant_layouts
from packlora.kernels.cpu.ops import pack_args
from packlora.quant import quantize

RNG = np.random.default_rng(7)

# The walker's own K-quant layouts (kernels/cpu/chunks.py), checked here by walking their chunk
# addresses in numpy against gguf.quants.
_KQ = kquant_layouts()
Q4_K, Q6_K = _KQ["q4_k"], _KQ["q6_k"]


def _f16(raw, at):
    return np.float32(raw[at:at + 2].view("<f2")[0])


def _codes(raw, chunk, at):
    """The 32 codes of a chunk from its addresses in the model."""
    q = (raw[at:at + 32] >> chunk.plane) & 0x0F
    if chunk.high_at is not None:
        q = q | (((raw[chunk.high_at:chunk.high_at + 32] >> chunk.high_shift) & 3) << 4)
    return q.astype(np.float32)


def _q4_k_scale_min(sc, j):
    """get_scale_min_k4 of ggml-quants.c: 6-bit scale and min of sub-block j."""
    if j < 4:
        return sc[j] & 63, sc[j + 4] & 63
    return (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)


def _decode_with_model(layout, row, sub_value):
    """A row of K-quant blocks decoded by walking the model's chunk addresses."""
    nch = row.size // layout.stride * len(layout.chunks)
    out = np.empty(nch * 32, np.float32)
    for c in range(nch):
        head, at, chunk = chunk_address(layout, 0, c)
        block = row[head:head + layout.stride]
        out[32 * c:32 * c + 32] = sub_value(block, chunk, _codes(block, chunk, at - head))
    return out


def _q4_k_values(block, chunk, q):
    d, dmin = _f16(block, Q4_K.scale_at), _f16(block, Q4_K.min_at)
    sc, m = _q4_k_scale_min(block[Q4_K.sub_scales_at:Q4_K.sub_scales_at + 12],
                            chunk.sub_scales[0])
    return d * np.float32(sc) * q - dmin * np.float32(m)


def _q6_k_values(block, chunk, q):
    d = _f16(block, Q6_K.scale_at)
    scales = block[Q6_K.sub_scales_at:Q6_K.sub_scales_at + 16].view(np.int8)
    lanes = np.repeat([scales[i] for i in chunk.sub_scales], 16).astype(np.float32)
    return d * lanes * (q - np.float32(32))


def _random_blocks(layout, n, halves):
    raw = RNG.integers(0, 256, (n, layout.stride), dtype=np.uint8)
    for at in halves:  # small finite fp16 scales
        raw[:, at:at + 2] = RNG.uniform(0.01, 0.1, (n, 1)).astype("<f2").view(np.uint8)
    return raw


def test_q4_k_super_blocks_are_one_more_layout():
    assert (Q4_K.elems, Q4_K.stride) == GGML_QUANT_SIZES[T.Q4_K]
    raw = _random_blocks(Q4_K, 3, (0, 2)).reshape(-1)
    want = gguf.quants.dequantize(raw, T.Q4_K).reshape(-1)
    np.testing.assert_allclose(_decode_with_model(Q4_K, raw, _q4_k_values), want, rtol=1e-5,
                               atol=1e-6)


def test_q6_k_super_blocks_are_one_more_layout():
    assert (Q6_K.elems, Q6_K.stride) == GGML_QUANT_SIZES[T.Q6_K]
    raw = _random_blocks(Q6_K, 3, (208,)).reshape(-1)
    want = gguf.quants.dequantize(raw, T.Q6_K).reshape(-1)
    np.testing.assert_allclose(_decode_with_model(Q6_K, raw, _q6_k_values), want, rtol=1e-5,
                               atol=1e-6)


def test_the_walker_takes_blocks_of_several_chunks():
    """A Q8_0-like block of 64 values (fp16 d, 64 int8) through the real SIMD codegen."""
    wide = ChunkLayout("i8", "f16", 66, (Chunk(2), Chunk(34)))
    dec, dot, axpy = (simd.make_dispatch(op, layouts=(wide,))
                      for op in (simd.DECODE, simd.DOT, simd.AXPY))
    blocks = RNG.integers(-100, 100, (3, 66), dtype=np.int8).view(np.uint8)
    d = RNG.uniform(0.01, 0.1, 3).astype("<f2")
    blocks[:, :2] = d.view(np.uint8).reshape(3, 2)
    want = (blocks[:, 2:].view(np.int8).astype(np.float32) * d.astype(np.float32)[:, None])
    pk = pack_args(quantize(np.ones((1, 32), np.float32), "q8_0"))
    pk = pk[:4] + (blocks.reshape(-1),) + pk[5:]

    @njit
    def run(pk, out, x, y):  # blocks 1 and 2: bytes from 66, four chunks
        dec(0, pk, 66, 4, 0, 0, np.float32(1.0), out, 0)
        axpy(0, pk, 66, 4, 0, 0, np.float32(0.5), y, 0)
        return dot(0, pk, 66, 4, 0, 0, np.float32(1.0), x, 0)

    x = RNG.standard_normal(128).astype(np.float32)
    out, y = np.zeros(128, np.float32), np.ones(128, np.float32)
    got = run(pk, out, x, y)
    np.testing.assert_array_equal(out, want[1:].reshape(-1))
    np.testing.assert_allclose(y, 1 + 0.5 * want[1:].reshape(-1), rtol=1e-6, atol=1e-6)
    assert abs(got - x @ want[1:].reshape(-1)) < 1e-4
