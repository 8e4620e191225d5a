"""CUDA device functions for the block formats: the ggml blocks of 32 (Q4_0, Q4_1, Q8_0, Q5_0,
Q5_1), the K-quant super-blocks (Q2_K..Q6_K), 16-bit float rows (F16/BF16) and the table
formats IQ4_NL / IQ4_XS. Value j of a block is `block_code(j) * s + o` with (s, o) =
`block_affine(j)`, the same for every value of a scale group (SCALE_GROUP values at a multiple
of it): a run within one group reads its scales once. The value orders are quant/kquants.py's
and quant/iquants.py's; every offset is the registry layout's, baked into the kernels as
constants, IQ4's table a constant array."""
import numpy as np
from numba import cuda, float32, int32

from ...quant import REGISTRY
from ...quant.registry import FLAT
from ..format_ids import FORMAT_IDS
from .bits import bf16_to_float, signed_byte

Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, F16, BF16, IQ4_NL, IQ4_XS = (
    FORMAT_IDS[n] for n in ("q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k",
                            "q5_k", "q6_k", "f16", "bf16", "iq4_nl", "iq4_xs"))
_L4_0, _L4_1, _L8_0, _L5_0, _L5_1, _L2, _L3, _L4, _L5, _L6 = (
    REGISTRY[n].layout for n in ("q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k",
                                 "q5_k", "q6_k"))
Q4_0_CODES, Q4_1_CODES, Q4_1_MIN, Q8_0_CODES = (_L4_0.codes_at, _L4_1.codes_at, _L4_1.min_at,
                                                _L8_0.codes_at)
Q5_0_CODES, Q5_0_HIGH = _L5_0.codes_at, _L5_0.high_bits_at
Q5_1_CODES, Q5_1_HIGH, Q5_1_MIN = _L5_1.codes_at, _L5_1.high_bits_at, _L5_1.min_at
Q2_CODES, Q2_SC, Q2_D, Q2_M = _L2.codes_at, _L2.sub_scales_at, _L2.scale_at, _L2.min_at
Q3_CODES, Q3_HIGH, Q3_SC, Q3_D = _L3.codes_at, _L3.high_bits_at, _L3.sub_scales_at, _L3.scale_at
Q4_CODES, Q4_SC, Q4_D, Q4_M = _L4.codes_at, _L4.sub_scales_at, _L4.scale_at, _L4.min_at
Q5_CODES, Q5_HIGH, Q5_SC, Q5_D, Q5_M = (_L5.codes_at, _L5.high_bits_at, _L5.sub_scales_at,
                                        _L5.scale_at, _L5.min_at)
Q6_CODES, Q6_HIGH, Q6_SC, Q6_D = _L6.codes_at, _L6.high_bits_at, _L6.sub_scales_at, _L6.scale_at
_LNL, _LXS = REGISTRY["iq4_nl"].layout, REGISTRY["iq4_xs"].layout
NL_CODES, NL_D = _LNL.codes_at, _LNL.scale_at
XS_CODES, XS_SC, XS_D = _LXS.codes_at, _LXS.sub_scales_at, _LXS.scale_at
IQ4_TABLE = REGISTRY["iq4_nl"].codebook  # float32 (codebooks.IQ4_CODE)
assert IQ4_TABLE is REGISTRY["iq4_xs"].codebook
assert (Q4_SC, Q4_D, Q4_M) == (Q5_SC, Q5_D, Q5_M)  # block_affine reads both at Q4_K's bytes
# the ggml blocks of 32: one fp16 d at byte 0 (the affines below read it there), and ids up
# to Q5_1's (`fmt <= Q5_1` below picks them among the block formats)
assert max(Q4_0, Q4_1, Q8_0, Q5_0) < Q5_1 < min(Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, F16, BF16, IQ4_NL,
                                                IQ4_XS)
assert all(lay.elems == 32 and lay.scale_at == 0 for lay in (_L4_0, _L4_1, _L8_0, _L5_0, _L5_1))


def _block_table(field):
    """A registry layout field (values or bytes per block) by format id, 0 for flat formats:
    a constant array of the compiled kernels."""
    table = np.zeros(len(FORMAT_IDS), np.int32)
    for name, fid in FORMAT_IDS.items():
        if REGISTRY[name].storage != FLAT:
            table[fid] = getattr(REGISTRY[name].layout, field)
    table.setflags(write=False)
    return table


BLOCK_ELEMS, BLOCK_BYTES = _block_table("elems"), _block_table("nbytes")
# f16_at reads fp16 values through a float16 view of the blocks: every block's size and every
# fp16 in it (scale, min; a 16-bit row's values at 2j) at an even byte offset
assert all(e.layout.nbytes % 2 == 0 and all(at % 2 == 0 for at in (e.layout.scale_at,
                                                                   e.layout.min_at) if at)
           for e in REGISTRY.values() if e.storage != FLAT)
# Values that share one (s, o): every block format's scale group (K-quant sub-block, ggml
# block; 16-bit rows have no scale) is a multiple of this.
SCALE_GROUP = 16
assert all(e.storage == FLAT or (e.layout.sub_elems or e.layout.elems) % SCALE_GROUP == 0
           for e in REGISTRY.values())


@cuda.jit(device=True, cache=True)
def f16_at(q16, at):
    """The fp16 value at byte offset `at` (even) of a block buffer, from its float16 view: one
    hardware conversion."""
    return float32(q16[at >> 1])


@cuda.jit(device=True, cache=True)
def _nibble(q, at, j):
    """4-bit code j of 32 packed in 16 bytes at `at` (ggml: low nibbles first, then high)."""
    if j < 16:
        return int32(q[at + j]) & 15
    return int32(q[at + j - 16]) >> 4


@cuda.jit(device=True, cache=True)
def _ggml_code(q, base, j, fmt):
    """Code j of a ggml block of 32, its offset taken off (Q4_0's 8, Q5_0's 16)."""
    if fmt == Q8_0:
        return float32(signed_byte(q[base + Q8_0_CODES + j]))
    if fmt == Q4_0:
        return float32(_nibble(q, base + Q4_0_CODES, j) - 8)
    if fmt == Q4_1:
        return float32(_nibble(q, base + Q4_1_CODES, j))
    low = _nibble(q, base + (Q5_0_CODES if fmt == Q5_0 else Q5_1_CODES), j)
    hi = base + (Q5_0_HIGH if fmt == Q5_0 else Q5_1_HIGH)
    code = low | (((int32(q[hi + (j >> 3)]) >> (j & 7)) & 1) << 4)
    return float32(code - 16) if fmt == Q5_0 else float32(code)


@cuda.jit(device=True, cache=True)
def _scale_min_k4(q, at, s):
    """get_scale_min_k4: 6-bit scale and min of sub-block s (0..7) from 12 bytes at `at`."""
    if s < 4:
        return int32(q[at + s]) & 63, int32(q[at + s + 4]) & 63
    sc = (int32(q[at + s + 4]) & 15) | ((int32(q[at + s - 4]) >> 6) << 4)
    mn = (int32(q[at + s + 4]) >> 4) | ((int32(q[at + s]) >> 6) << 4)
    return sc, mn


@cuda.jit(device=True, cache=True)
def _q45_k_code(q, base, j, fmt):
    """Q4_K / Q5_K code j: nibble (j // 32) % 2 of byte 32 (j // 64) + j % 32."""
    codes = base + (Q4_CODES if fmt == Q4_K else Q5_CODES)
    code = (int32(q[codes + 32 * (j >> 6) + (j & 31)]) >> (4 * ((j >> 5) & 1))) & 15
    if fmt == Q5_K:
        code |= ((int32(q[base + Q5_HIGH + (j & 31)]) >> (j >> 5)) & 1) << 4
    return float32(code)


@cuda.jit(device=True, cache=True)
def _iq4_xs_scale(q, at, s):
    """IQ4_XS's scale of sub-block s (0..7) less 32: 2 high bits at bit 2s of the uint16 at
    `at`, 4 low bits in nibble s % 2 of byte at + 2 + s // 2."""
    low = (int32(q[at + 2 + (s >> 1)]) >> (4 * (s & 1))) & 15
    return (low | (((int32(q[at + (s >> 2)]) >> (2 * (s & 3))) & 3) << 4)) - 32


@cuda.jit(device=True, cache=True)
def _q6_k_code(q, base, j):
    h, r = j >> 7, j & 127
    jj, lane = r >> 5, r & 31
    low = (int32(q[base + Q6_CODES + 64 * h + 32 * (jj & 1) + lane]) >> (4 * (jj >> 1))) & 15
    high = (int32(q[base + Q6_HIGH + 32 * h + lane]) >> (2 * jj)) & 3
    return float32((low | (high << 4)) - 32)


@cuda.jit(device=True, cache=True)
def _q23_k_code(q, base, j, fmt):
    h, jj, lane = j >> 7, (j & 127) >> 5, j & 31
    code = (int32(q[base + (Q2_CODES if fmt == Q2_K else Q3_CODES) + 32 * h + lane])
            >> (2 * jj)) & 3
    if fmt == Q2_K:
        return float32(code)
    return float32((code | (((int32(q[base + Q3_HIGH + lane]) >> (j >> 5)) & 1) << 2)) - 4)


@cuda.jit(device=True, cache=True)
def block_code(q, q16, base, j, fmt):
    """Code j of the block of format `fmt` whose bytes start at q[base], offset taken off (a
    16-bit row's value itself)."""
    if fmt == F16:
        return f16_at(q16, base + 2 * j)
    if fmt == BF16:
        return bf16_to_float(q[base + 2 * j], q[base + 2 * j + 1])
    if fmt <= Q5_1:
        return _ggml_code(q, base, j, fmt)
    if fmt == IQ4_NL:
        return IQ4_TABLE[_nibble(q, base + NL_CODES, j)]
    if fmt == IQ4_XS:
        return IQ4_TABLE[_nibble(q, base + XS_CODES + 16 * (j >> 5), j & 31)]
    if fmt == Q4_K or fmt == Q5_K:
        return _q45_k_code(q, base, j, fmt)
    if fmt == Q6_K:
        return _q6_k_code(q, base, j)
    return _q23_k_code(q, base, j, fmt)


@cuda.jit(device=True, cache=True)
def block_affine(q, q16, base, j, fmt):
    """(s, o) of value j's scale group: value = code * s + o (formulas as the references').
    Formats without a min add -0.0: x + -0.0 is x for every x, so the add folds away."""
    zero = float32(-0.0)
    if fmt == F16 or fmt == BF16:
        return float32(1.0), zero
    if fmt <= Q5_1:
        if fmt == Q4_1 or fmt == Q5_1:
            return f16_at(q16, base), f16_at(q16, base + (Q4_1_MIN if fmt == Q4_1 else Q5_1_MIN))
        return f16_at(q16, base), zero
    if fmt == IQ4_NL:
        return f16_at(q16, base + NL_D), zero
    if fmt == IQ4_XS:
        return f16_at(q16, base + XS_D) * float32(_iq4_xs_scale(q, base + XS_SC, j >> 5)), zero
    if fmt == Q4_K or fmt == Q5_K:
        sc, mn = _scale_min_k4(q, base + Q4_SC, j >> 5)  # Q4_SC == Q5_SC, d, dmin as well
        return (f16_at(q16, base + Q4_D) * float32(sc),
                -(f16_at(q16, base + Q4_M) * float32(mn)))
    i = j >> 4
    if fmt == Q6_K:
        return f16_at(q16, base + Q6_D) * float32(signed_byte(q[base + Q6_SC + i])), zero
    if fmt == Q2_K:
        sb = int32(q[base + Q2_SC + i])
        return (f16_at(q16, base + Q2_D) * float32(sb & 15),
                -(f16_at(q16, base + Q2_M) * float32(sb >> 4)))
    low = (int32(q[base + Q3_SC + (i & 7)]) >> (4 * (i >> 3))) & 15
    sc = low | (((int32(q[base + Q3_SC + 8 + (i & 3)]) >> (2 * (i >> 2))) & 3) << 4)
    return f16_at(q16, base + Q3_D) * float32(sc - 32), zero
