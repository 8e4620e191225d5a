"""llama.cpp's own tokenizer test suite: its vocab-only GGUF files (ggml-vocab-NAME.gguf) with
texts (.inp, cases split by __ggml_vocab_test__) and the token ids llama.cpp gives (.out, one
line per case). scripts/test.sh unpacks them from llama-cpp-python's source distribution
(vendor/llama.cpp/models/, MIT licence) into PACKLORA_LLAMA_VOCAB."""
import importlib.util
import os
from pathlib import Path

import pytest
from gguf import GGUFValueType
from packlora import load_tokenizer
from packlora.gguf_out.stream import GGUFStream
from packlora.models.gguf_file import open_gguf

VOCAB_DIR = Path(os.environ.get("PACKLORA_LLAMA_VOCAB",
                                Path.home() / ".cache/packlora/llama-vocab"))
NAMES = ["llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2", "deepseek-llm", "deepseek-coder",
         "falcon", "starcoder", "refact", "mpt", "command-r", "qwen35"]
SEPARATOR = "\n__ggml_vocab_test__\n"


def cases(name):
    """[(text, ids)] of one vocabulary's test file pair."""
    base = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not (base.is_file() and Path(f"{base}.inp").is_file()):
        pytest.skip(f"llama.cpp's vocab tests not unpacked in {VOCAB_DIR} "
                    "(scripts/test.sh does it from llama-cpp-python's sdist)")
    texts = Path(f"{base}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    texts[-1] = texts[-1].removesuffix("\n__ggml_vocab_test__\n").removesuffix(
        "\n__ggml_vocab_test__")
    outs = Path(f"{base}.out").read_text(encoding="utf-8").split("\n")
    want = [[int(t) for t in line.split()] for line in outs[:len(texts)]]
    return base, list(zip(texts, want))


@pytest.mark.parametrize("name", NAMES)
def test_llama_cpp_tokenizer_cases(name):
    path, pairs = cases(name)
    tok = load_tokenizer(path)
    wrong = [(text, tok.encode(text), ids) for text, ids in pairs if tok.encode(text) != ids]
    assert not wrong, f"{name}: {len(wrong)} of {len(pairs)} cases differ, first: {wrong[0]}"


@pytest.mark.parametrize("name", ["llama-spm", "qwen2"])
@pytest.mark.parametrize("add_bos,add_eos", [(True, True), (False, True), (True, False)])
def test_special_tokens_added_as_llama_cpp_adds_them(name, add_bos, add_eos, tmp_path):
    """tokenizer.ggml.add_bos_token / add_eos_token, against llama.cpp itself on a copy of the
    vocabulary with the flags set."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (scripts/test.sh builds it once)")
    import llama_cpp  # optional: only where scripts/test.sh installed it
    base, pairs = cases(name)
    kv = [item for item in open_gguf(base).typed_fields()
          if item[0] not in ("general.architecture", "tokenizer.ggml.add_bos_token",
                             "tokenizer.ggml.add_eos_token")]
    kv += [("tokenizer.ggml.add_bos_token", add_bos, GGUFValueType.BOOL, None),
           ("tokenizer.ggml.add_eos_token", add_eos, GGUFValueType.BOOL, None)]
    path = tmp_path / "vocab.gguf"
    with GGUFStream(path, open_gguf(base).architecture, kv, []):
        pass
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    tok = load_tokenizer(path)
    for text, _ in pairs[:12]:
        want = llm.tokenize(text.encode(), add_bos=True, special=False)  # add_special: the flags
        assert tok.encode(text, add_special_tokens=True) == want, text
