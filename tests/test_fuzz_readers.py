"""Hostile files: every reader of user-supplied bytes (GGUF models, safetensors adapters and
packed weights, adapter_config.json, JSONL data, YAML configs) either reads the file or raises a
PackloraError that names it — no other exception, no hang, no allocation sized by a number read
from the file. Mutations: truncation at every section boundary, byte flips in headers and
metadata, absurd counts and lengths, invalid UTF-8. Bounded in count and time for CI."""
import json
import struct
import time

import gguf
import model_factory as mf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packlora.adapters.peft_io import read_adapter
from packlora.config import load_config
from packlora.data.jsonl import read_jsonl
from packlora.errors import PackloraError
from packlora.models.gguf_file import open_gguf
from packlora.quant import PackedWeight, load_packed, quantize, save_packed
from safetensors.numpy import save_file

SECONDS_PER_INPUT = 5.0
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
TRIED, REFUSED = {}, {}


def _try(name, path, read):
    """Run `read(path)`; only success or a PackloraError naming the file may come out."""
    TRIED[name] = TRIED.get(name, 0) + 1
    t0 = time.monotonic()
    try:
        read(path)
    except PackloraError as e:
        REFUSED[name] = REFUSED.get(name, 0) + 1
        assert str(path) in str(e) or path.name in str(e), f"error does not name the file: {e}"
    assert time.monotonic() - t0 < SECONDS_PER_INPUT, f"{name}: reading took too long"


def _mutants(base, boundaries, draw_flips, absurd):
    """Truncations at boundaries, byte flips, and u64 fields overwritten with absurd values."""
    out = [base[:b] for b in boundaries]
    out += [bytes(m) for m in draw_flips]
    for pos in absurd:
        for value in (2**40, 2**50, 2**63 - 1, 2**64 - 1):
            m = bytearray(base)
            m[pos:pos + 8] = struct.pack("<Q", value)
            out.append(bytes(m))
    return out


def _flip(base, positions, values):
    m = bytearray(base)
    for p, v in zip(positions, values):
        m[p % len(m)] ^= v or 1
    return m


# --- GGUF ----------------------------------------------------------------------------------
def _read_gguf(path):
    f = open_gguf(path)
    _ = f.config, f.tokenizer
    for name in f.tensor_names():
        kind, shape, data = f.tensor(name)
        np.asarray(data[:1]).sum()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path, _ = mf.write_gguf(tmp_path_factory.mktemp("fz") / "m.gguf", "llama", "Q8_0",
                            vocab=True)
    tok = open_gguf(path).tokenizer  # the vocabulary the flips below land in
    assert tok.encode("abcd") == [tok.token_to_id("abc"), tok.token_to_id("d")]
    raw = path.read_bytes()
    r = gguf.GGUFReader(str(path))
    bounds = {0, 4, 8, 16, 24, len(raw) - 1, r.data_offset, r.data_offset - 1}
    for field in r.fields.values():
        bounds.update(int(field.offset) + d for d in (0, 8, 12))
    for t in r.tensors:
        bounds.update((int(t.field.offset), int(r.data_offset + t.data_offset)))
    # u64 positions: tensor count, kv count, string lengths of keys, tensor dims
    absurd = [8, 16] + [int(f.offset) for f in list(r.fields.values())[:6]]
    absurd += [int(t.field.offset) for t in r.tensors[:3]]
    return raw, sorted(b for b in bounds if 0 <= b < len(raw)), absurd, int(r.data_offset)


def test_gguf_truncated_everywhere_and_absurd_counts(gguf_file, tmp_path):
    raw, bounds, absurd, _ = gguf_file
    for i, data in enumerate(_mutants(raw, bounds, [], absurd)):
        p = tmp_path / f"t{i}.gguf"
        p.write_bytes(data)
        _try("gguf", p, _read_gguf)


@FUZZ
@given(st.lists(st.integers(0, 2**31), min_size=1, max_size=8),
       st.lists(st.integers(0, 255), min_size=8, max_size=8))
def test_gguf_byte_flips(gguf_file, tmp_path, positions, values):
    raw, _, _, header_end = gguf_file  # flips in the header and metadata, not the weights
    p = tmp_path / "f.gguf"
    p.write_bytes(bytes(_flip(raw, [q % header_end for q in positions], values)))
    _try("gguf", p, _read_gguf)


# --- safetensors: adapters and packed weights ---------------------------------------------
@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ad")
    rng = np.random.default_rng(0)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
               rng.standard_normal((4, 64)).astype(np.float32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
               np.zeros((64, 4), np.float32)}, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    return d


def _safetensors_mutants(raw):
    (n,) = struct.unpack("<Q", raw[:8])
    bounds = [0, 4, 8, 9, 8 + n // 2, 8 + n - 1, 8 + n, 8 + n + 1, len(raw) - 1]
    return _mutants(raw, bounds, [], [0])


def test_adapter_weights_truncated_and_absurd_header(adapter_dir, tmp_path):
    raw = (adapter_dir / "adapter_model.safetensors").read_bytes()
    (tmp_path / "adapter_config.json").write_text("{}")
    for data in _safetensors_mutants(raw):
        (tmp_path / "adapter_model.safetensors").write_bytes(data)
        _try("adapter", tmp_path / "adapter_model.safetensors",
             lambda p: read_adapter(p.parent))


@FUZZ
@given(st.binary(max_size=300))
def test_adapter_config_any_bytes(adapter_dir, tmp_path, blob):
    (tmp_path / "adapter_model.safetensors").write_bytes(
        (adapter_dir / "adapter_model.safetensors").read_bytes())
    (tmp_path / "adapter_config.json").write_bytes(blob)
    _try("adapter_config", tmp_path / "adapter_config.json", lambda p: read_adapter(p.parent))


@pytest.fixture(scope="module")
def packed_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("pk") / "w.safetensors"
    w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    save_packed(p, {"a": quantize(w, "nf4", 64, double_quant=True), "b": np.ones(3, np.float32)})
    return p


def _read_packed(path):
    tensors, _ = load_packed(path)
    for t in tensors.values():
        if isinstance(t, PackedWeight):
            t.dequantize()


def test_packed_weights_truncated_and_absurd_header(packed_file, tmp_path):
    for i, data in enumerate(_safetensors_mutants(packed_file.read_bytes())):
        p = tmp_path / f"p{i}.safetensors"
        p.write_bytes(data)
        _try("packed", p, _read_packed)


@FUZZ
@given(st.lists(st.integers(0, 2**31), min_size=1, max_size=6),
       st.lists(st.integers(0, 255), min_size=6, max_size=6))
def test_packed_weights_header_flips(packed_file, tmp_path, positions, values):
    raw = packed_file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    p = tmp_path / "p.safetensors"
    p.write_bytes(bytes(_flip(raw, [8 + q % n for q in positions], values)))
    _try("packed", p, _read_packed)


# --- text formats ---------------------------------------------------------------------------
@FUZZ
@given(st.lists(st.one_of(st.binary(max_size=60), st.sampled_from(
    [b'{"text": "hi"}', b'{"messages": [', b"[1, 2]", b"\xff\xfe", b'{"a": 1e999}', b"null"])),
    max_size=6))
def test_jsonl_any_lines(tmp_path, lines):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b"\n".join(lines))
    _try("jsonl", p, lambda q: list(read_jsonl(q)))


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.sampled_from([
    b"model: x\ndata: {train: t.jsonl}\nlora: {rank: [1]}\n", b"a: &x [*x]\n", b"- 1\n- 2\n",
    b"model: m\nmodel: n\n", b"train: {lr: 1e-5, max_steps: -1}\n", b"\xef\xbb\xbfmodel: 1\n",
    b"model: !!python/object:os.system x\n"])))
def test_yaml_config_any_bytes(tmp_path, blob):
    p = tmp_path / "c.yaml"
    p.write_bytes(blob)
    _try("yaml", p, load_config)


def test_zz_report_counts():
    print("fuzzed inputs per reader:", json.dumps(TRIED, sort_keys=True),
          "refused with a clear error:", json.dumps(REFUSED, sort_keys=True))
    assert sum(TRIED.values()) > 200 and sum(REFUSED.values()) > 100
