"""The metadata of a GGUF that packlora writes: copied from a GGUF base, or — for a Hugging Face
base — what llama.cpp's converter would write: the architecture's hyper-parameters and the
tokenizer as `tokenizer.ggml.*` (byte-level BPE; its pre-tokenizer name is the one whose
llama.cpp rules give the same token ids as the base's own tokenizer.json on a probe text)."""
import json

from gguf import GGUFValueType as V
from gguf import LlamaFileType

from ..errors import ModelError
from ..gguf_tokenizer import (
    PRE_TOKENIZER_REGEXES,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
)
from ..tokenizer import Tokenizer

FILE_TYPE, CHAT_TEMPLATE = "general.file_type", "tokenizer.chat_template"
# --quantize -> general.file_type (llama.cpp's llama_ftype)
FILE_TYPES = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
              "q2_k": LlamaFileType.MOSTLY_Q2_K, "q3_k": LlamaFileType.MOSTLY_Q3_K_S,
              "bf16": LlamaFileType.MOSTLY_BF16, "q4_0": LlamaFileType.MOSTLY_Q4_0,
              "q4_1": LlamaFileType.MOSTLY_Q4_1, "q5_0": LlamaFileType.MOSTLY_Q5_0,
              "q5_1": LlamaFileType.MOSTLY_Q5_1, "q8_0": LlamaFileType.MOSTLY_Q8_0,
              "q4_k": LlamaFileType.MOSTLY_Q4_K_S, "q5_k": LlamaFileType.MOSTLY_Q5_K_S,
              "q6_k": LlamaFileType.MOSTLY_Q6_K, "q3_k_s": LlamaFileType.MOSTLY_Q3_K_S,
              "q3_k_m": LlamaFileType.MOSTLY_Q3_K_M, "q3_k_l": LlamaFileType.MOSTLY_Q3_K_L,
              "q4_k_s": LlamaFileType.MOSTLY_Q4_K_S, "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
              "q5_k_s": LlamaFileType.MOSTLY_Q5_K_S,
              "q5_k_m": LlamaFileType.MOSTLY_Q5_K_M, "iq4_nl": LlamaFileType.MOSTLY_IQ4_NL,
              "iq4_xs": LlamaFileType.MOSTLY_IQ4_XS}
# Text the candidate pre-tokenizers must split as the base's tokenizer does: digits of every
# length, contractions, runs of spaces and newlines, punctuation, accents, CJK, emoji.
PROBE = ("Hello world! It's 3 o'clock, 12 or 123 or 1234567 apples.\n\n  \tIndented   text "
         "don't WON'T we'll I'M\r\n" "naïve café — résumé; ½ … “quotes” (parens) [x] {y}\n"
         "日本語のテキスト 한국어 Ελληνικά русский 🦙🚀 a+b=c; x==y || z!=w $100 #tag @name\n"
         "    def f(x):\n        return x**2  # comment\n")


def gguf_base_kv(gguf_file):
    """Every metadata key of a GGUF base except the architecture (the writer's own)."""
    return [kv for kv in gguf_file.typed_fields() if kv[0] != "general.architecture"]


def file_type_kv(kv, quantize_to):
    """kv with general.file_type saying what --quantize made of the linear weights."""
    kv = [item for item in kv if item[0] != FILE_TYPE]
    return [*kv, (FILE_TYPE, int(FILE_TYPES[quantize_to]), V.UINT32, None)]


def chat_template_kv(kv, template):
    """kv with tokenizer.chat_template set to `template` (the one an adapter was trained with)."""
    kv = [item for item in kv if item[0] != CHAT_TEMPLATE]
    return [*kv, (CHAT_TEMPLATE, template, V.STRING, None)]


def hf_base_kv(base, name):
    """The metadata llama.cpp needs for a Hugging Face base: architecture and tokenizer."""
    tok = base.source.tokenizer
    if tok is None:
        raise ModelError(f"{base.path}: the base has no tokenizer.json; a GGUF file needs one")
    return [("general.type", "model", V.STRING, None),
            ("general.name", str(name), V.STRING, None),
            ("general.quantization_version", 2, V.UINT32, None),
            *architecture_kv(base.arch, base.config), *tokenizer_kv(tok, base.config)]


def architecture_kv(arch, cfg):
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") != "linear":
        raise ModelError(f"{cfg.source}: rope_scaling {cfg.rope_scaling.get('rope_type')!r} "
                         "is not written to GGUF here (llama.cpp stores it as a rope_freqs "
                         "tensor); merge into an HF folder instead")
    out = [("context_length", cfg.max_position_embeddings, V.UINT32),
           ("embedding_length", cfg.hidden_size, V.UINT32),
           ("block_count", cfg.num_layers, V.UINT32),
           ("feed_forward_length", cfg.intermediate_size, V.UINT32),
           ("attention.head_count", cfg.num_heads, V.UINT32),
           ("attention.head_count_kv", cfg.num_kv_heads, V.UINT32),
           ("attention.key_length", cfg.head_dim, V.UINT32),
           ("attention.value_length", cfg.head_dim, V.UINT32),
           ("rope.dimension_count", cfg.head_dim, V.UINT32),
           ("rope.freq_base", cfg.rope_theta, V.FLOAT32),
           ("attention.layer_norm_rms_epsilon", cfg.rms_norm_eps, V.FLOAT32),
           ("vocab_size", cfg.vocab_size, V.UINT32)]
    if cfg.rope_scaling:
        out += [("rope.scaling.type", "linear", V.STRING),
                ("rope.scaling.factor", float(cfg.rope_scaling["factor"]), V.FLOAT32)]
    return [(f"{arch}.{k}", v, t, None) for k, v, t in out]


def tokenizer_kv(tok, cfg):
    """tokenizer.ggml.* of a byte-level BPE tokenizer.json (SmolLM, Llama 3, Qwen2, ...)."""
    data = tok.to_json()
    model = data.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
        raise ModelError(f"{tok.source}: only byte-level BPE tokenizers are written to GGUF "
                         "from tokenizer.json; a SentencePiece model needs its GGUF base")
    tokens, types = _vocabulary(model, data.get("added_tokens") or [], cfg.vocab_size)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    if not merges:
        raise ModelError(f"{tok.source}: the BPE tokenizer has no merges; llama.cpp's gpt2 "
                         "tokenizer needs them")
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    pre = detect_pre(tok, {**fields, "tokenizer.ggml.eos_token_id": tok.eos_token_id})
    kv = [(k, v, V.ARRAY, V.INT32 if k.endswith("token_type") else V.STRING)
          for k, v in fields.items() if k != "tokenizer.ggml.model"]
    kv = [("tokenizer.ggml.model", "gpt2", V.STRING, None), *kv,
          ("tokenizer.ggml.pre", pre, V.STRING, None)]
    for key, value in (("bos_token_id", tok.bos_token_id), ("eos_token_id", tok.eos_token_id),
                       ("padding_token_id", tok.pad_token_id)):
        if value is not None:
            kv.append((f"tokenizer.ggml.{key}", int(value), V.UINT32, None))
    kv.append(("tokenizer.ggml.add_bos_token", bool(tok.add_bos_token), V.BOOL, None))
    kv.append(("tokenizer.ggml.add_eos_token", bool(tok.add_eos_token), V.BOOL, None))
    if tok.chat_template:
        kv.append((CHAT_TEMPLATE, tok.chat_template, V.STRING, None))
    return kv


def _vocabulary(model, added, vocab_size):
    n = max([vocab_size, len(model["vocab"])] + [a["id"] + 1 for a in added])
    tokens, types = [f"[PAD{i}]" for i in range(n)], [TOKEN_UNUSED] * n
    for text, i in model["vocab"].items():
        tokens[i], types[i] = text, TOKEN_NORMAL
    for a in added:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = TOKEN_CONTROL if a.get("special") else TOKEN_USER_DEFINED
    return tokens, types


def detect_pre(tok, fields):
    """The first llama.cpp pre-tokenizer name under which the GGUF tokenizer gives the ids the
    base's tokenizer gives on PROBE; ModelError when none does."""
    want = tok.encode(PROBE)
    tried = []
    for pre, rules in PRE_TOKENIZER_REGEXES.items():
        if rules in tried:  # another name for rules already tried (smollm = starcoder = ...)
            continue
        tried.append(rules)
        candidate = Tokenizer.from_gguf({**fields, "tokenizer.ggml.pre": pre}, tok.source)
        if candidate.encode(PROBE) == want:
            return pre
    raise ModelError(f"{tok.source}: no llama.cpp pre-tokenizer splits text as this tokenizer "
                     f"does (tried {', '.join(PRE_TOKENIZER_REGEXES)})")
