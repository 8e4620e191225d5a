"""A llama.cpp LoRA adapter GGUF read as an adapter: files written here with gguf's own writer in
the layout llama.cpp's convert_lora_to_gguf.py writes (per-tensor types, Q/K rows in the
converter's order, one alpha), loaded, merged and refused where they cannot be. That llama.cpp
reads the same file to the same logits is tests/test_llama_cpp_adapters.py."""
import gguf
import model_factory as mf
import numpy as np
import pytest
from packlora import load_adapter, load_model
from packlora.adapters.deltas import AdapterDeltas
from packlora.errors import ModelError
from packlora.export import export_model
from safetensors.numpy import load_file

Q8 = gguf.GGMLQuantizationType.Q8_0
# module -> (rank, heads whose Q/K rows the converter permutes, or None)
MODULES = {"model.layers.0.self_attn.q_proj": (4, mf.HEADS),
           "model.layers.0.self_attn.k_proj": (4, mf.KV_HEADS),
           "model.layers.1.mlp.down_proj": (2, None)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder, _ = mf.write_hf(tmp_path_factory.mktemp("base") / "m", "llama")
    return folder


def _deltas(seed=0):
    """{module: (A (r, in), B (out, r))} in Hugging Face row order."""
    rng = np.random.default_rng(seed)
    shapes = {"q_proj": (mf.HEADS * mf.HEAD_DIM, mf.HIDDEN),
              "k_proj": (mf.KV_HEADS * mf.HEAD_DIM, mf.HIDDEN), "down_proj": (mf.HIDDEN, mf.INTER)}
    out = {}
    for module, (r, _) in MODULES.items():
        n_out, n_in = shapes[module.rsplit(".", 1)[1]]
        out[module] = (rng.standard_normal((r, n_in)).astype(np.float32),
                       rng.standard_normal((n_out, r)).astype(np.float32))
    return out


def _write(path, deltas, alpha, arch="llama", extra=(), kv=()):
    """An adapter GGUF as the converter writes one: lora_a Q8_0 where its rows allow, lora_b F16
    (r values a row), Q/K lora_b rows permuted for llama."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    if isinstance(alpha, str):
        w.add_string("adapter.lora.alpha", alpha)
    else:
        w.add_float32("adapter.lora.alpha", alpha)
    for key, value in kv:
        w.add_array(key, value)
    for module, (a, b) in deltas.items():
        heads = MODULES[module][1]
        name = mf.to_gguf_name(f"{module}.weight")
        w.add_tensor(f"{name}.lora_a", gguf.quants.quantize(a, Q8), raw_dtype=Q8)
        w.add_tensor(f"{name}.lora_b", (mf.llama_permute(b, heads) if heads else b)
                     .astype(np.float16))
    for name, arr in extra:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alpha", [8.0, 0.0])
def test_a_llama_cpp_lora_loads_with_its_rows_and_scales(base, tmp_path, alpha):
    deltas = _deltas()
    path = _write(tmp_path / "a.gguf", deltas, alpha)
    model = load_adapter(load_model(base, quant="none"), path)
    merged = AdapterDeltas(path, model.config)
    for module, (a, b) in deltas.items():
        r = MODULES[module][0]
        layer = model.get_module(module)
        a_read = gguf.quants.dequantize(gguf.quants.quantize(a, Q8), Q8)
        np.testing.assert_array_equal(layer.lora_A.numpy(), a_read, err_msg=module)
        np.testing.assert_array_equal(layer.lora_B.numpy(), b.astype(np.float16)
                                      .astype(np.float32), err_msg=module)
        want = alpha / r if alpha else 1.0  # llama.cpp's scale: alpha / r, or 1 with no alpha
        assert layer.scale == pytest.approx(want) and merged.scale(module) == pytest.approx(want)
    adapted = {p for p, _ in model.named_modules() if hasattr(_, "lora_A")}
    assert adapted == set(MODULES)  # those modules and no others


def test_a_merge_of_the_gguf_is_the_merge_of_its_deltas(base, tmp_path):
    deltas = _deltas(1)
    path = _write(tmp_path / "a.gguf", deltas, 8.0)
    out = export_model(base, tmp_path / "merged", adapter=path)
    got = load_file(str(out / "model.safetensors"))
    plain = load_file(str(base / "model.safetensors"))
    for module, (a, b) in deltas.items():
        a = gguf.quants.dequantize(gguf.quants.quantize(a, Q8), Q8)
        b = b.astype(np.float16).astype(np.float32)
        want = plain[f"{module}.weight"] + (8.0 / MODULES[module][0]) * (b @ a)
        np.testing.assert_allclose(got[f"{module}.weight"], want, rtol=1e-5, atol=1e-5)


def test_what_cannot_be_read_is_one_clear_error(base, tmp_path):
    deltas = _deltas()
    model_gguf, _ = mf.write_gguf(tmp_path / "model.gguf", "llama")
    cases = [
        (model_gguf, "a model GGUF, not an adapter"),
        (_write(tmp_path / "embd.gguf", deltas, 8.0,
                extra=[("token_embd.weight.lora_a", np.zeros((4, mf.VOCAB), np.float32)),
                       ("token_embd.weight.lora_b", np.zeros((mf.HIDDEN, 4), np.float32))]),
         "'token_embd.weight.lora_a' adapts a tensor packlora has no LoRA layer for"),
        (_write(tmp_path / "half.gguf", deltas, 8.0,
                extra=[("blk.1.attn_v.weight.lora_b", np.zeros((32, 4), np.float32))]),
         "every .lora_b needs its .lora_a"),
        (_write(tmp_path / "alora.gguf", deltas, 8.0,
                kv=[("adapter.alora.invocation_tokens", [5, 6])]), "an activated LoRA"),
        (_write(tmp_path / "qwen.gguf", deltas, 8.0, arch="qwen2"),  # its Q/K rows: HF order
         "an adapter for a 'qwen2' model, and the base is 'llama' \\('llama' in GGUF\\)"),
        (_write(tmp_path / "text.gguf", deltas, "8"),  # was an internal ValueError
         "text.gguf: adapter.lora.alpha must be a finite number >= 0 .*, got '8'"),
        (_write(tmp_path / "minus.gguf", deltas, -8.0),  # was named "lora_alpha"
         "minus.gguf: adapter.lora.alpha must be a finite number >= 0 .*, got -8.0"),
    ]
    for path, words in cases:
        with pytest.raises(ModelError, match=words):
            load_adapter(load_model(base, quant="none"), path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((tmp_path / "embd.gguf").read_bytes()[:200])
    with pytest.raises(ModelError, match="not a valid GGUF file"):
        load_adapter(load_model(base, quant="none"), cut)
    with pytest.raises(ModelError, match="is read with its base model"):
        AdapterDeltas(tmp_path / "alora.gguf")
