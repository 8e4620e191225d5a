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
          "i8",     # 32 signed bytes
          "tab4",   # 16 bytes: value 2i in the high nibble of byte i, 2i+1 in the low; a table
          "planes")  # one nibble plane of 32 bytes (+ high bits at high_at): K-quants
SCALES = ("f16",      # the block header's fp16 d
          "f16_min",  # fp16 d and fp16 m: d * q + m
          "absmax",   # the absmax of flat block (g0 + c) >> sh
          "absmax_dq",  # the same, double-quantized
          "absmax_127",  # absmax / 127 (int8)
          "sub")      # packed sub-block scales (K-quants: not decoded by the walker yet)


@dataclass(frozen=True)
class Chunk:
    """Where one chunk of a block sits (offsets in bytes from the block's start)."""

    codes_at: int
    plane: int = 0
    high_at: int | None = None
    high_shift: int = 0
    sub_scales: tuple = ()


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
