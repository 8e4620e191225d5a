"""The format registry is the one place for format facts: everything else agrees with it."""
import typing

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf_blocks import random_blocks
from packlora import QuantError
from packlora.config import QuantConfig
from packlora.kernels import format_ids
from packlora.kernels.cpu import simd
from packlora.kernels.cuda import decode as cuda_decode
from packlora.models.gguf_file import SUPPORTED_TENSOR_TYPES
from packlora.models.sources import gguf_packed_format
from packlora.quant import (
    BY_GGUF_NAME,
    FORMATS,
    GGUF_TYPE_NAMES,
    REGISTRY,
    bits_per_weight,
    buffer_spec,
    check_buffers,
    packed_nbytes,
    quantize,
)
from packlora.quant import formats as quant_formats
from packlora.quant.presets import PRESETS

GGUF_ENTRIES = [f for f in REGISTRY.values() if f.gguf_type is not None]


def test_registry_names_are_the_public_formats():
    assert tuple(REGISTRY) == FORMATS
    assert all(name == entry.name for name, entry in REGISTRY.items())
    assert not hasattr(quant_formats, "BLOCKWISE")


@pytest.mark.parametrize("entry", GGUF_ENTRIES, ids=lambda f: f.name)
def test_gguf_block_layout_matches_gguf(entry):
    elems, nbytes = GGML_QUANT_SIZES[entry.gguf_type]
    if entry.float16:  # gguf's F16 / BF16 "blocks" are single values; ours runs of 32 of them
        assert (elems, nbytes) == (1, 2) and entry.layout.elems % 32 == 0
        elems, nbytes = entry.layout.elems, entry.layout.elems * nbytes
    assert (entry.layout.elems, entry.layout.nbytes) == (elems, nbytes)
    assert entry.name == entry.gguf_type.name.lower() == entry.gguf_name.lower()
    assert entry.block_sizes == (elems,) and entry.default_block_size == elems
    assert BY_GGUF_NAME[entry.gguf_name] is entry
    assert bits_per_weight(entry.name) == nbytes * 8 / elems
    assert packed_nbytes(entry.name, (3, 4 * elems)) == 3 * 4 * nbytes


# gguf.quants quantizes the blocks of 32 but IQ4_NL; the K-quants' and IQ4's quantizers are
# checked against llama.cpp's (tests/test_kquant_quality.py)
@pytest.mark.parametrize("entry", [f for f in GGUF_ENTRIES
                                   if f.layout.elems == 32 and f.codebook is None],
                         ids=lambda f: f.name)
def test_gguf_reference_codec_is_gguf_quants(entry):
    x = np.random.default_rng(3).standard_normal((4, 2 * entry.layout.elems)).astype(np.float32)
    buffers = entry.quantize(entry, x, entry.default_block_size, False, "w")
    want = np.asarray(gguf.quants.quantize(x, entry.gguf_type))  # F16 / BF16 come as 16 bits
    np.testing.assert_array_equal(buffers["blocks"],
                                  want.view(np.uint8).reshape(buffers["blocks"].shape))
    got = entry.dequantize(entry, buffers, x.shape, entry.default_block_size)
    np.testing.assert_array_equal(got, gguf.quants.dequantize(buffers["blocks"],
                                                              entry.gguf_type))


@pytest.mark.parametrize("entry", GGUF_ENTRIES, ids=lambda f: f.name)
def test_gguf_reference_decoder_is_gguf_quants(entry):
    """Every GGUF type's decoder (K-quants included) on random blocks, ragged row counts."""
    rng = np.random.default_rng(5)
    for n, blocks in ((1, 1), (3, 2), (5, 6)):
        raw = random_blocks(entry.name, n, blocks * entry.layout.elems, rng)
        got = entry.dequantize(entry, {"blocks": raw}, (n, blocks * entry.layout.elems),
                               entry.default_block_size)
        want = gguf.quants.dequantize(raw, entry.gguf_type)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("entry", REGISTRY.values(), ids=lambda f: f.name)
def test_every_entry_round_trips_through_its_codec(entry):
    x = np.random.default_rng(4).standard_normal((6, 256)).astype(np.float32)
    pw = quantize(x, entry.name, double_quant=entry.double_quant)
    assert pw.block_size in entry.block_sizes
    assert pw.nbytes == packed_nbytes(entry.name, x.shape, double_quant=entry.double_quant)
    assert np.abs(pw.dequantize() - x).max() < 0.5 * np.abs(x).max()


def test_config_literal_is_the_registry():
    literal = typing.get_args(QuantConfig.model_fields["format"].annotation)
    assert literal == (*FORMATS, *PRESETS, "none")  # the mixed presets pick registry formats
    assert set(PRESETS.values()) <= set(FORMATS)
    for entry in REGISTRY.values():
        if entry.fixed_block:
            assert QuantConfig(format=entry.name).block_size == entry.default_block_size


def test_loaders_and_planner_keep_the_registry_types_packed():
    assert GGUF_TYPE_NAMES == tuple(f.gguf_name for f in GGUF_ENTRIES)
    for name in GGUF_TYPE_NAMES:  # the loader and the planner share gguf_packed_format
        assert gguf_packed_format(name, (64, 256)) == BY_GGUF_NAME[name].name
    assert gguf_packed_format("IQ2_XS", (64, 256)) is None
    assert gguf_packed_format("F32", (64, 256)) is None
    # 16-bit floats stay 16-bit as rows of whole 32-blocks; norms and odd rows become float32
    assert gguf_packed_format("F16", (8,)) is None and gguf_packed_format("BF16", (4, 33)) is None
    assert set(GGUF_TYPE_NAMES) <= set(SUPPORTED_TENSOR_TYPES)


def test_kernel_format_ids_are_one_numbering():
    ids = format_ids.FORMAT_IDS
    assert list(ids) == list(REGISTRY) and sorted(ids.values()) == list(range(len(REGISTRY)))
    for name in ("NF4", "FP4", "INT8", "Q4_0", "Q4_1", "Q8_0"):
        assert getattr(format_ids, name) == ids[name.lower()] == getattr(cuda_decode, name)


def test_simd_layouts_derive_from_the_registry():
    for kind, name in ((simd.Q4_0, "q4_0"), (simd.Q4_1, "q4_1"), (simd.Q8_0, "q8_0")):
        lay, reg = simd.LAYOUTS[kind], REGISTRY[name].layout
        assert (lay.stride, lay.elems, lay.chunks[0].codes_at) == (reg.nbytes, reg.elems,
                                                                    reg.codes_at)
        assert (lay.scale_at, lay.min_at) == (reg.scale_at, reg.min_at)
    assert simd.LAYOUTS[simd.TAB4].stride == 16 and simd.LAYOUTS[simd.I8].stride == 32
    assert set(simd.FORMAT_KINDS) == set(REGISTRY)
    for name, kind in simd.FORMAT_KINDS.items():
        lay, reg = simd.LAYOUTS[kind], REGISTRY[name]
        if reg.storage == "ggml":
            assert (lay.stride, lay.elems) == (reg.layout.nbytes, reg.layout.elems), name


def test_buffers_checked_once_against_the_layout():
    spec = buffer_spec("q8_0", (2, 64), 32)
    assert spec == {"blocks": (np.dtype(np.uint8), (2, 68))}
    check_buffers("q8_0", (2, 64), 32, False, {"blocks": np.zeros((2, 68), np.uint8)})
    with pytest.raises(QuantError, match="must be uint8"):
        check_buffers("q8_0", (2, 64), 32, False, {"blocks": np.zeros((2, 67), np.uint8)})
    with pytest.raises(QuantError, match="needs buffers"):
        check_buffers("nf4", (2, 64), 64, False, {"codes": np.zeros(64, np.uint8)})


def test_kernels_check_weights_with_the_registry():
    w = quantize(np.ones((4, 64), np.float32), "q4_1")
    assert format_ids.checked_format(w) is REGISTRY["q4_1"]
    good = w.buffers["blocks"]
    w.buffers["blocks"] = good[:, :-1]
    with pytest.raises(QuantError, match="q4_1 buffer 'blocks'"):
        format_ids.checked_format(w)
    w.buffers["blocks"] = good.copy()  # the check is made once per layout, not per weight
    assert format_ids.checked_format(w) is REGISTRY["q4_1"]
    w.buffers["blocks"] = good.view(np.int8)
    with pytest.raises(QuantError, match="must be uint8"):
        format_ids.checked_format(w)
    w.buffers["blocks"], w.shape = good, (2, 128)
    with pytest.raises(QuantError, match=r"must be uint8 \(2, 80\)"):
        format_ids.checked_format(w)
