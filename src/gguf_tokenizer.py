"""Tokenizers from a GGUF file's `tokenizer.ggml.*` metadata, built on the `tokenizers` library
the way llama.cpp (llama-vocab.cpp) tokenizes:

  gpt2   byte-level BPE: the file's merges, the `pre` tokenizer's regexes applied in turn
  llama  SentencePiece BPE: symbols are characters; the adjacent pair whose concatenation is
         in the vocabulary with the highest score merges first; what stays outside the
         vocabulary falls back to <0xXX> byte tokens; spaces are "▁", and with
         add_space_prefix one leads every run of text (after each special token too)

The oracle is llama.cpp's own tokenizer test suite (tests/test_gguf_vocabs.py)."""
from __future__ import annotations

import warnings

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .errors import ModelError

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
              r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek LLM's letters: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee, ... as ranges
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a"
    "\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
    "\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# llama.cpp (llama-vocab.cpp) pre-tokenizer regexes, applied one after the other, by `pre` name.
PRE_TOKENIZER_REGEXES = {
    "smollm": [r"\p{N}", _GPT2_RE], "starcoder": [r"\p{N}", _GPT2_RE],
    "refact": [r"\p{N}", _GPT2_RE], "command-r": [r"\p{N}", _GPT2_RE],
    "gpt2": [_GPT2_RE], "gpt-2": [_GPT2_RE], "mpt": [_GPT2_RE],
    "llama3": [_LLAMA3_RE], "llama-v3": [_LLAMA3_RE], "llama-bpe": [_LLAMA3_RE],
    "qwen2": [_QWEN2_RE], "deepseek-r1-qwen": [_QWEN2_RE], "qwen35": [_QWEN35_RE],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE, r"[0-9][0-9][0-9]"],
    "deepseek-llm": [r"[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + "]+",
                     "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                     r"\s+$", _CJK, r"\p{N}+"],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"],
}
_IGNORE_MERGES = ("llama3", "llama-v3", "llama-bpe")  # llama.cpp looks whole words up first

# token_type values of tokenizer.ggml.token_type (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = \
    1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space
KINDS = ("gpt2", "llama")


def gguf_backend(fields: dict, source: str):
    """(tokenizers.Tokenizer, {bos_token, eos_token, pad_token, add_bos_token, add_eos_token,
    chat_template}) of GGUF metadata `fields`; ModelError naming `source` and the key where the
    kind is not supported or the vocabulary is missing or malformed."""
    kind = fields.get("tokenizer.ggml.model")
    if kind not in KINDS:
        raise ModelError(f"{source}: tokenizer.ggml.model {kind!r} is not supported "
                         f"(supported: gpt2 byte-level BPE, llama SentencePiece)")
    tokens = fields.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelError(f"{source}: GGUF metadata lacks tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelError(f"{source}: tokenizer.ggml.tokens must be an array of strings")
    types = _per_token(fields, "tokenizer.ggml.token_type", tokens, int, source)
    backend = _bpe(fields, tokens, source) if kind == "gpt2" else _spm(fields, tokens, types,
                                                                        source)
    _add_special_tokens(backend, tokens, types)

    def text(key):
        i = _special_id(fields, key, tokens, source)
        return None if i is None else tokens[i]
    special = {"bos_token": text("tokenizer.ggml.bos_token_id"),
               "eos_token": text("tokenizer.ggml.eos_token_id"),
               "pad_token": text("tokenizer.ggml.padding_token_id"),
               "add_bos_token": fields.get("tokenizer.ggml.add_bos_token", kind == "llama"),
               "add_eos_token": fields.get("tokenizer.ggml.add_eos_token", False),
               "chat_template": fields.get("tokenizer.chat_template")}
    if not isinstance(special["chat_template"], (str, type(None))):
        raise ModelError(f"{source}: tokenizer.chat_template must be a string, not "
                         f"{type(special['chat_template']).__name__}")
    return backend, special


def _bpe(fields, tokens, source):
    merges = fields.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelError(f"{source}: GGUF metadata lacks tokenizer.ggml.merges")
    pre = fields.get("tokenizer.ggml.pre", "default")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = _merge_pairs(merges, vocab, source)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs,
                                     ignore_merges=pre in _IGNORE_MERGES))
    backend.pre_tokenizer = pre_tokenizer(pre, source)
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm(fields, tokens, types, source):
    scores = _per_token(fields, "tokenizer.ggml.scores", tokens, float, source)
    if scores is None:
        raise ModelError(f"{source}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one "
                         "per token")
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    unk = _special_id(fields, "tokenizer.ggml.unknown_token_id", tokens, source)
    bpe = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, vocab), byte_fallback=True,
                     fuse_unk=True, unk_token=None if unk is None else tokens[unk])
    backend = HFTokenizer(bpe)
    prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _per_token(fields, key, tokens, kind, source):
    """The array at `key` holding one number (`kind`: int, or float which takes ints too) per
    token, or None where the file has no such key."""
    values = fields.get(key)
    if values is None:
        return None
    kinds = (int, float) if kind is float else (int,)
    if not (isinstance(values, list) and len(values) == len(tokens)
            and all(isinstance(v, kinds) and not isinstance(v, bool) for v in values)):
        raise ModelError(f"{source}: {key} must hold one number per token ({len(tokens)} "
                         f"tokens), got {_described(values)}")
    return values


def _described(values) -> str:
    if not isinstance(values, list):
        return f"a {type(values).__name__}"
    odd = next((v for v in values if not isinstance(v, (int, float)) or isinstance(v, bool)),
               None)
    return f"{len(values)} values" + (f", one of them {odd!r}" if odd is not None else "")


def _special_id(fields, key, tokens, source) -> int | None:
    """A special token's id; one that is no token id is ignored with a warning, as llama.cpp
    ignores it ("bad special token")."""
    i = fields.get(key)
    if i is None:
        return None
    if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tokens):
        return i
    warnings.warn(f"{source}: {key} {i!r} is no token id (the vocabulary has {len(tokens)} "
                  "tokens); ignored", stacklevel=4)
    return None


def _merge_pairs(merges, vocab, source) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges as (left, right) pairs; each side and their join must be tokens
    (the tokenizers library would stop the process on a join that is none)."""
    if not isinstance(merges, list):
        raise ModelError(f"{source}: tokenizer.ggml.merges must be an array of strings")
    pairs = []
    for n, m in enumerate(merges):
        cut = m.find(" ", 1) if isinstance(m, str) else -1  # llama.cpp: a token may lead with " "
        pair = [m[:cut], m[cut + 1:]] if cut > 0 else []
        missing = [t for t in (*pair, "".join(pair)) if t not in vocab]
        if len(pair) != 2 or missing:
            why = (f"{missing[0]!r} is not a token" if len(pair) == 2
                   else "not two tokens with a space between")
            raise ModelError(f"{source}: tokenizer.ggml.merges[{n}] {m!r}: {why}")
        pairs.append(tuple(pair))
    return pairs


def spm_merges(tokens, scores, vocab):
    """SentencePiece's scores as BPE merges: every split of a token into two tokens of the
    vocabulary, ranked by the whole token's score (highest first), ties by vocabulary order."""
    found = []
    for i, tok in enumerate(tokens):
        if vocab.get(tok) != i:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                found.append((-float(scores[i]), vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def pre_tokenizer(pre: str, source: str):
    """The byte-level pre-tokenizer of a gpt2-kind vocabulary's `pre` name."""
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        warnings.warn(f"{source}: pre-tokenizer {pre!r} is not known; using the gpt2 regex",
                      stacklevel=3)
        regexes = PRE_TOKENIZER_REGEXES["gpt2"]
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _add_special_tokens(backend, tokens, token_types) -> None:
    """Control tokens become special tokens; user-defined ones are matched whole too."""
    if token_types is None:
        return
    added = [AddedToken(tokens[i], special=(t == TOKEN_CONTROL), normalized=False)
             for i, t in enumerate(token_types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    backend.add_special_tokens([a for a in added if a.special])
    backend.add_tokens([a for a in added if not a.special])
