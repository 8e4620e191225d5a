"""Code tables: the bitsandbytes formats' NF4, FP4 (E2M1) and 8-bit dynamic maps, and the
values of GGUF's IQ4_NL / IQ4_XS codes."""
import numpy as np

_F32 = np.float32

# NF4 values indexed by the 4-bit code, as bitsandbytes dequantizes them
# (functional.get_4bit_type("nf4") and nf4_dequantization_lut in csrc/kernels.cu).
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=_F32)

# bitsandbytes' quantizer (dQuantizeNF4) is a decision tree over these 15 pivots, written as
# float literals (so rounded to float32) in csrc/kernels.cu. The tree returns the upper code only
# when x > pivot (strictly), so code(x) = number of pivots strictly below x.
NF4_PIVOTS = np.array([
    -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
    -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
    0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
    0.5016634166240692, 0.6427869200706482, 0.8614784181118011,
], dtype=_F32)

# FP4 (1 sign, 2 exponent, 1 mantissa bit) normalized by its largest magnitude 12, in code
# order (functional.get_4bit_type("fp4")). Code 8 is +0.0 there (the list holds the int -0).
FP4_CODE = (np.array([0, 0.0625, 8, 12, 4, 6, 2, 3, 0, -0.0625, -8, -12, -4, -6, -2, -3],
                     dtype=_F32) / _F32(12)).astype(_F32)

# dQuantizeFP4: sign bit 0b1000 when x < 0, then a tree on |x| over these float32 pivots
# (again strict >). FP4_RANK_TO_CODE maps the number of pivots below |x| to the 3-bit code.
FP4_PIVOTS = np.array([0.00260417, 0.0859375, 0.20833333, 0.29166667, 0.4166667, 0.583333,
                       0.8333333], dtype=_F32)
FP4_RANK_TO_CODE = np.array([0b000, 0b001, 0b110, 0b111, 0b100, 0b101, 0b010, 0b011], np.uint8)


def _linspace_f32(steps):
    """torch.linspace(0.1, 1, steps, dtype=float32) as torch evaluates it.

    Each point is start + step*i (first half) or end - step*(steps-1-i) (second half), with
    step = (end - start) / (steps - 1) in float32 and the multiply-add rounded once. The
    resulting 256-entry map equals the tables other projects dumped from bitsandbytes.
    """
    start, end = _F32(0.1), _F32(1.0)
    step = np.float64((end - start) / _F32(steps - 1))
    idx = np.arange(steps, dtype=np.float64)
    first = np.float64(start) + step * idx              # exact in float64, one rounding below
    second = np.float64(end) - step * (steps - 1 - idx)
    return np.where(idx < steps // 2, first, second).astype(_F32)


def _create_dynamic_map(signed=True):
    """bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): per decade
    i = 0..6, the midpoints of linspace(0.1, 1) scaled by 10^(i-6) — 2^i of them and their
    negatives when signed, 2^(i+1) when not — then 0 and 1."""
    values = []
    for i in range(7):
        bounds = _linspace_f32(2 ** (i if signed else i + 1) + 1)
        means = (bounds[:-1] + bounds[1:]) / _F32(2)    # float32, as torch computes it
        scale = _F32(10.0 ** (i - 6))
        values.append(scale * means)
        if signed:
            values.append(-scale * means)
    values.append(np.array([0.0, 1.0], dtype=_F32))
    table = np.sort(np.concatenate(values).astype(_F32))
    assert table.shape == (256,)
    return table


# IQ4_NL / IQ4_XS: the 16 values (int8 in ggml: kvalues_iq4nl in ggml-common.h), ascending, a
# 4-bit code stands for, scaled by the block's fp16 d (IQ4_XS: times its 6-bit sub-block scale
# - 32); float32 as the other tables
IQ4_CODE = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                    dtype=_F32)

DYNAMIC_MAP = _create_dynamic_map()
# The unsigned map bitsandbytes' 8-bit optimizers keep Adam's second moment in.
DYNAMIC_MAP_UNSIGNED = _create_dynamic_map(signed=False)
DYNAMIC_MAP.setflags(write=False)
DYNAMIC_MAP_UNSIGNED.setflags(write=False)
for _table in (NF4_CODE, NF4_PIVOTS, FP4_CODE, FP4_PIVOTS, FP4_RANK_TO_CODE, IQ4_CODE):
    _table.setflags(write=False)

