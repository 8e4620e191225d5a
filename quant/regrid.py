"""Re-quantize changed weights onto the grid they are stored on, rounding stochastically.

A LoRA merge changes a weight by far less than its quantization step: W' = deq(Q(W)) + δ with
|δ| mostly under half a step. Quantizing W' afresh rounds it to the nearest point — the base's
own point — and the adapter vanishes (or, with new scales, every weight's rounding is rolled
again). Keeping each block's scales and rounding W' up or down with probability given by where
it lies between the two grid points keeps every element unbiased (E[deq] = W'), adds little
noise where δ is small, and leaves the block bytes' scales untouched.

Nothing here knows a format's bit layout: the format's own decoder is probed once, bit by bit,
to learn which element and which power of two each code bit is (ggml keeps codes in their own
byte ranges, BlockLayout.codes_at / high_bits_at). Codes that index a table (IQ4_NL, IQ4_XS)
are not powers of two: there each value rounds between the two table entries around it, times
its block's scale (quant/iquants.py)."""
import functools
from typing import NamedTuple

import numpy as np

from ..errors import QuantError
from .iquants import code_bytes, element_scales, pack_codes
from .registry import GGML_ROWS, REGISTRY


def _code_bytes(layout):
    """Byte offsets of one block that hold code bits: the low bits (a power of two: 2, 4 or 8
    per code) at codes_at, then the high bits (Q3_K's one, Q5's one, Q6_K's two)."""
    bits = layout.code_bits
    low = bits if layout.high_bits_at is None else 1 << (bits.bit_length() - 1)
    spans = [(layout.codes_at, layout.elems * low // 8)]
    if bits > low:
        spans.append((layout.high_bits_at, layout.elems * (bits - low) // 8))
    return np.concatenate([np.arange(at, at + n) for at, n in spans])


def _decode_blocks(entry, blocks):
    """(n, BPB) uint8 blocks -> (n, elems) float32 values, by the format's reference decoder."""
    n = blocks.shape[0]
    return entry.dequantize(entry, {"blocks": blocks}, (n, entry.layout.elems),
                            entry.default_block_size)


class BitMap(NamedTuple):
    """Where a format's codes sit, learned from its decoder (bits little-endian per byte)."""

    where: np.ndarray     # byte offsets within a block that hold code bits
    element: np.ndarray   # the element each code bit belongs to
    weight: np.ndarray    # the bit's signed value in its element's code (int16)
    lsb_bits: np.ndarray  # a block's bytes with every element's lowest code bit set
    lo: np.ndarray        # each element's smallest code
    hi: np.ndarray        # each element's largest code


@functools.cache
def bit_map(fmt) -> BitMap:
    """The BitMap of format `fmt`, probed once."""
    entry = REGISTRY[fmt]
    if entry.storage != GGML_ROWS or entry.float16 or entry.codebook is not None:
        raise QuantError(f"{fmt}: no stored grid to re-quantize onto")
    layout = entry.layout
    rng = np.random.default_rng(0)
    block = entry.quantize(entry, rng.standard_normal((1, layout.elems)).astype(np.float32),
                           None, False, "probe")["blocks"].reshape(layout.nbytes)
    where = _code_bytes(layout)
    zero = block.copy()
    zero[where] = 0
    nbits = where.size * 8
    probes = np.repeat(zero[None], nbits, axis=0)                    # (nbits, BPB)
    bit = np.arange(nbits)
    probes[bit, where[bit // 8]] = (1 << (bit % 8)).astype(np.uint8)
    change = _decode_blocks(entry, probes) - _decode_blocks(entry, zero[None])
    element = np.abs(change).argmax(axis=1)
    if ((change != 0).sum(axis=1) != 1).any():
        raise QuantError(f"{fmt}: a code bit changes more than one value; cannot re-grid")
    value = change[bit, element]      # signed: a block's scale may be negative (Q6_K)
    lsb = np.zeros(layout.elems, np.float32)
    for b in np.argsort(-np.abs(value), kind="stable"):  # ends with each element's smallest
        lsb[element[b]] = value[b]
    weight = np.rint(value / lsb[element]).astype(np.int16)
    lsb_bits = np.zeros(layout.nbytes, np.uint8)
    for b in np.flatnonzero(np.abs(weight) == 1):
        lsb_bits[where[b // 8]] |= np.uint8(1 << (b % 8))
    lo = np.zeros(layout.elems, np.int16)
    hi = np.zeros(layout.elems, np.int16)
    np.add.at(lo, element, np.minimum(weight, 0))
    np.add.at(hi, element, np.maximum(weight, 0))
    return BitMap(where, element, weight, lsb_bits, lo, hi)


def requantize_on_grid(fmt, stored, target, rng):
    """Blocks (rows, nb*BPB) uint8 of `fmt` holding `target` (rows, K) float32 on the grid of
    `stored` (same shape as the result): scales kept, codes stochastically rounded. A block
    whose new values go more than a step past its grid's range is quantized afresh."""
    entry = REGISTRY[fmt]
    if entry.codebook is not None:
        return _on_table(entry, stored, target, rng)
    layout = entry.layout
    where, element, weight, lsb_bits, lo, hi = bit_map(fmt)
    rows, k = target.shape
    zero = np.array(stored, np.uint8).reshape(rows * (k // layout.elems), layout.nbytes)
    zero[:, where] = 0                   # the blocks with every code 0; scales kept
    base = _decode_blocks(entry, zero)                              # (n, elems) value of code 0
    step = _decode_blocks(entry, zero | lsb_bits) - base            # (n, elems) one code step
    t = target.reshape(base.shape) - base
    flat = step == 0                     # a zero scale: the code does not matter
    codes = np.floor(t / np.where(flat, 1, step) + rng.random(t.shape, dtype=np.float32))
    codes = np.where(flat, 0, codes)
    # a block the merge takes more than a step past its grid's ends gets a grid of its own;
    # up to one step, clipping the few values there costs less than re-rounding the block
    outside = ((codes < lo - 1) | (codes > hi + 1)).any(axis=1)
    codes = np.clip(codes, lo, hi).astype(np.int16)                 # every code range fits
    bits = (codes[:, element] & np.abs(weight)) != 0                # (n, nbits) bool
    zero[:, where] = np.packbits(bits, axis=1, bitorder="little")
    if outside.any():
        fresh = target.reshape(base.shape)[outside]
        zero[outside] = entry.quantize(entry, fresh, None, False, "merged")["blocks"]
    return zero.reshape(rows, -1)


def _on_table(entry, stored, target, rng):
    """requantize_on_grid for a table format: each value's code drawn between the two table
    entries around target / its scale, unbiased; a block past the table's ends by more than
    its outer gaps is quantized afresh."""
    layout = entry.layout
    table = entry.codebook                                          # ascending
    rows, k = target.shape
    blocks = np.array(stored, np.uint8).reshape(rows * (k // layout.elems), layout.nbytes)
    scale = element_scales(blocks, layout)                          # (n, elems)
    t = np.where(scale == 0, 0, target.reshape(scale.shape) / np.where(scale == 0, 1, scale))
    lo = np.clip(np.searchsorted(table, t, side="right") - 1, 0, len(table) - 2)
    up = (t - table[lo]) / (table[lo + 1] - table[lo])              # < 0, > 1: past the ends
    codes = (lo + (rng.random(t.shape, dtype=np.float32) < up)).astype(np.uint8)
    outside = ((t < 2 * table[0] - table[1]) | (t > 2 * table[-1] - table[-2])).any(axis=1)
    blocks[:, code_bytes(layout)] = pack_codes(codes)
    if outside.any():
        fresh = target.reshape(scale.shape)[outside]
        blocks[outside] = entry.quantize(entry, fresh, None, False, "merged")["blocks"]
    return blocks.reshape(rows, -1)
