"""Merged weights put back on their stored grid (quant/regrid.py), decoded by the `gguf`
package: the stored weight itself comes back byte for byte, a small change is kept without
bias and within one step, and a block the change pushes out of range gets a grid of its own."""
import gguf
import numpy as np
import pytest
from packlora.quant import REGISTRY, quantize
from packlora.quant.regrid import requantize_on_grid

# every GGUF type with a grid (not F16 / BF16)
FORMATS = tuple(n for n, f in REGISTRY.items() if f.gguf_type is not None and not f.float16)


def _decode(fmt, blocks):
    return gguf.quants.dequantize(blocks, REGISTRY[fmt].gguf_type)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_stored_weight_comes_back_unchanged(fmt):
    w = np.random.default_rng(0).standard_normal((5, 512)).astype(np.float32)  # 5 rows: ragged
    stored = quantize(w, fmt).buffers["blocks"]
    again = requantize_on_grid(fmt, stored, _decode(fmt, stored), np.random.default_rng(1))
    assert np.array_equal(again, stored)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_small_change_is_kept_on_average(fmt):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((3, 256)).astype(np.float32)
    stored = quantize(w, fmt).buffers["blocks"]
    grid = _decode(fmt, stored)
    # each value moved toward the middle of its group of 16: never past its grid's ends, where
    # the merge clips (Q2_K's four levels put many values there)
    inward = np.sign(grid.reshape(-1, 16).mean(axis=1, keepdims=True) - grid.reshape(-1, 16))
    delta = 0.02 * np.abs(rng.standard_normal(w.shape)) * inward.reshape(w.shape)
    delta = (delta * (np.abs(grid) < 2)).astype(np.float32)
    draws = np.stack([_decode(fmt, requantize_on_grid(fmt, stored, grid + delta,
                                                      np.random.default_rng(s)))
                      for s in range(2400 if fmt == "q2_k" else 400)])  # Q2_K: 5x the step
    # every draw is one of the two grid points around the target: within one step of it (a
    # group of 16 values shares one step in every format; the draws that moved show it)
    moved = np.abs(draws - grid).reshape(len(draws), -1, 16).max(axis=(0, 2))
    step = np.repeat(moved, 16).reshape(grid.shape)
    assert (np.abs(draws - grid - delta) <= step + 1e-6).all()
    # unbiased: the mean of the draws converges on the target, not on the stored grid
    mean_err = np.abs(draws.mean(axis=0) - grid - delta).mean()
    assert mean_err < 0.25 * np.abs(delta).mean()
    nearest = quantize(grid + delta, fmt).buffers["blocks"]
    assert np.abs(_decode(fmt, nearest) - grid - delta).mean() > 2 * mean_err


@pytest.mark.parametrize("fmt", ("q4_1", "q8_0", "q3_k", "q6_k", "iq4_xs"))
def test_a_block_pushed_out_of_range_is_requantized_not_clipped(fmt):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 256)).astype(np.float32)
    stored = quantize(w, fmt).buffers["blocks"]
    target = _decode(fmt, stored)
    target[0, 7] = 10.0  # far outside every block's range
    got = _decode(fmt, requantize_on_grid(fmt, stored, target, np.random.default_rng(0)))
    assert abs(got[0, 7] - 10.0) < 1.0
