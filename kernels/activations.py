"""Whether packed products of one or two rows of x may round x to 8 bits: generation's choice.

Decoding multiplies one row of x per sequence by every weight. Inside `int8_activations()` the
CPU kernels quantize such an x per 32 values to 8 bits (one float scale each, as llama.cpp's
Q8_0 activations) and multiply it with the weight's codes in integer SIMD (cpu/gemv_int.py):
1.3-2x faster for the ggml, K-quant, int8 and nf4 / fp4 formats, with x's rounding (~0.4% of
a chunk's largest value per element) in the result, and for nf4 / fp4 their 16 table values
rounded to multiples of 1/127 as well (as llama.cpp's IQ4_NL stores its table). F16 / BF16
weights, larger batches and the CUDA kernels keep float32 x. Training, the loss and `eval`
never enter the block (packlora.generate does, unless asked for float activations).
"""
import contextlib

_INT8 = [False]


@contextlib.contextmanager
def int8_activations(on=True):
    """Within the block (when `on`), one- and two-row packed products take 8-bit x."""
    _INT8.append(bool(on))
    try:
        yield
    finally:
        _INT8.pop()


def int8_allowed():
    return _INT8[-1]
