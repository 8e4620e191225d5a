"""The chunk model of the SIMD row walker: where the 32-value chunks of a packed row sit.

A row is a run of blocks `stride` bytes apart. A block holds `len(chunks)` chunks of 32
consecutive values; chunk j's codes start `chunks[j].codes_at` bytes into its block (in the
nibble plane `plane`: 0 for the low nibbles, 4 for the high ones, where two chunks share the
same 32 bytes), its high bits (if any) at `high_at` shifted by `high_shift`, and its scale is
either the block header's (fp16 at `scale_at`, a min at `min_at`), a per-chunk sub-scale of
the packed sub-block scales at `sub_scales_at` (one index per group of lanes: K-quants), or the
absmax of a flat block. A ggml block of 32 is one chunk; a K-quant super-block of 256 is eight.

The walker unrolls the chunks of a block with these offsets as constants, so a one-chunk layout
compiles to one loop over chunks at a constant stride.
"""
from dataclasses import dataclass

from ...quant import REGISTRY

LANES = 32

# How a chunk's 32 codes turn into values (before scale), and where its scale comes from.
VALUES = ("q4_0",   # 16 bytes: value j in the low nibble of byte j, j + 16 in the high; minus 8
          "q4",     # the same without the offset
          "q5",     # q4 nibbles + bit j of the uint32 at high_at as bit 4 of value j, - offset
          "i8",     # 32 signed bytes
          "tab4",   # 16 bytes: value 2i in the high nibble of byte i, 2i+1 in the low; a table
          "iq4",    # q4's 16 bytes, each code looked up in the format's table (IQ4_NL, IQ4_XS)
          "planes",  # K-quants: value l = (byte l >> plane) & (2^code_bits - 1) of 32 bytes, or'd
#                     with high_bits bits of byte l at high_at (>> high_shift) above, - offset
          "f16",     # 32 little-endian IEEE halves (64 bytes)
          "bf16")    # 32 little-endian bfloat16 (64 bytes): the high halves of float32s
SCALES = ("f16",      # the block header's fp16 d
          "f16_min",  # fp16 d and fp16 m: d * q + m
          "absmax",   # the absmax of flat block (g0 + c) >> sh
          "absmax_dq",  # the same, double-quantized
          "absmax_127",  # absmax / 127 (int8)
          "k4",       # Q4_K/Q5_K: d * sc - dmin * mn, 6-bit (sc, mn) packed in 12 bytes
          "k6",       # Q6_K: d * int8 scale, one per 16 lanes
          "k2",       # Q2_K: d * (s & 15) - dmin * (s >> 4), a byte s per 16 lanes
          "k3",       # Q3_K: d * (sc - 32), 6-bit sc per 16 lanes packed in 12 bytes
          "iq4_xs",   # IQ4_XS: d * (sc - 32), 6-bit sc per 32 lanes: high bits in a uint16,
#                       low nibbles in the 4 bytes after it
          "one")      # none: the values are the weights (F16, BF16)
KQ_SCALES = ("k4", "k6", "k2", "k3", "iq4_xs")  # packed sub-block scales of super-blocks


@dataclass(frozen=True)
class Chunk:
    """Where one chunk of a block sits (offsets in bytes from the block's start)."""

    codes_at: int
    plane: int = 0
    high_at: int | None = None
    high_shift: int = 0
    sub_scales: tuple = ()     # sub-block scale index per 16 lanes (one: all 32 lanes)


@dataclass(frozen=True)
class ChunkLayout:
    """The blocks of a row as the SIMD walker reads them."""

    values: str
    scale: str
    stride: int                # bytes from one block to the next
    chunks: tuple              # Chunk per 32 values of a block
    scale_at: int = 0
    min_at: int | None = None
    sub_scales_at: int | None = None
    code_bits: int = 4         # "planes": bits of the low part of a code
    high_bits: int = 0         # "planes": bits of its high part
    offset: int = 0            # subtracted from every code ("q5", "planes")

    @property
    def elems(self):
        """Values per block."""
        return LANES * len(self.chunks)


def chunk_address(layout, row_byte, c):
    """(block byte, codes byte, chunk) of chunk c of the row whose blocks start at row_byte."""
    blk, j = divmod(c, len(layout.chunks))
    head = row_byte + blk * layout.stride
    chunk = layout.chunks[j]
    return head, head + chunk.codes_at, chunk


def ggml_layout(name, values, scale):
    """The one-chunk layout of a ggml format of the registry (blocks of 32)."""
    lay = REGISTRY[name].layout
    assert lay.elems == LANES, f"{name}: blocks of {lay.elems}, not one chunk"
    return ChunkLayout(values, scale, lay.nbytes, (Chunk(lay.codes_at),), lay.scale_at,
                       lay.min_at)


def flat_layout(name, values, scale):
    """A flat format's codes seen as one-chunk blocks of 32 codes (scales in their own buffer)."""
    return ChunkLayout(values, scale, LANES * REGISTRY[name].layout.code_bits // 8, (Chunk(0),))


def half_layout(name):
    """F16 / BF16: one chunk of 32 16-bit floats per 64-byte "block", no scale."""
    lay = REGISTRY[name].layout
    assert lay.elems == LANES and lay.code_bits == 16, f"{name}: not 32 16-bit values per block"
    return ChunkLayout(name, "one", lay.nbytes, (Chunk(lay.codes_at),))


def q5_layout(name, scale):
    """Q5_0 / Q5_1: one chunk, nibbles as q4, 32 high bits in a little-endian uint32."""
    lay = REGISTRY[name].layout
    return ChunkLayout("q5", scale, lay.nbytes, (Chunk(lay.codes_at, high_at=lay.high_bits_at),),
                       lay.scale_at, lay.min_at, offset=16 if lay.min_at is None else 0)


def _kquant(name, scale, chunk, values="planes", **kw):
    """A 256-value super-block as eight chunks; chunk(j, layout) places chunk j."""
    lay = REGISTRY[name].layout
    assert lay.elems == 8 * LANES, f"{name}: blocks of {lay.elems}"
    return ChunkLayout(values, scale, lay.nbytes, tuple(chunk(j, lay) for j in range(8)),
                       lay.scale_at, lay.min_at, lay.sub_scales_at, **kw)


def iq4_xs_layout():
    """IQ4_XS: eight chunks of IQ4_NL's 16 code bytes in a row, a 6-bit scale each
    (quant/iquants.py)."""
    return _kquant("iq4_xs", "iq4_xs", lambda j, L: Chunk(L.codes_at + 16 * j, sub_scales=(j,)),
                   values="iq4")


def kquant_layouts():
    """{format: layout} of the K-quants (value orders: quant/kquants.py)."""
    pairs = (lambda j: (2 * j, 2 * j + 1))  # sub-blocks of 16: two per chunk
    return {
        "q2_k": _kquant("q2_k", "k2", lambda j, L: Chunk(
            L.codes_at + 32 * (j // 4), plane=2 * (j % 4), sub_scales=pairs(j)), code_bits=2),
        "q3_k": _kquant("q3_k", "k3", lambda j, L: Chunk(
            L.codes_at + 32 * (j // 4), plane=2 * (j % 4), high_at=L.high_bits_at,
            high_shift=j, sub_scales=pairs(j)), code_bits=2, high_bits=1, offset=4),
        "q4_k": _kquant("q4_k", "k4", lambda j, L: Chunk(
            L.codes_at + 32 * (j // 2), plane=4 * (j % 2), sub_scales=(j,))),
        "q5_k": _kquant("q5_k", "k4", lambda j, L: Chunk(
            L.codes_at + 32 * (j // 2), plane=4 * (j % 2), high_at=L.high_bits_at,
            high_shift=j, sub_scales=(j,)), high_bits=1),
        "q6_k": _kquant("q6_k", "k6", lambda j, L: Chunk(
            L.codes_at + 64 * (j // 4) + 32 * (j % 2), plane=4 * (j % 4 // 2),
            high_at=L.high_bits_at + 32 * (j // 4), high_shift=2 * (j % 4),
            sub_scales=pairs(j)), high_bits=2, offset=32),
    }
