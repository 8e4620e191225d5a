"""llama.cpp's own tokenizer test suite: its vocab-only GGUF files (ggml-vocab-NAME.gguf) with
texts (.inp, cases split by __ggml_vocab_test__) and the token ids llama.cpp gives (.out, one
line per case). scripts/test.sh unpacks them from llama-cpp-python's source distribution
(vendor/llama.cpp/models/, MIT licence) into PACKLORA_LLAMA_VOCAB."""
import os
from pathlib import Path

import pytest
from packlora import load_tokenizer

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
