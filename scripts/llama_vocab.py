"""Unpack llama.cpp's tokenizer test suite from llama-cpp-python's source distribution: the
vocab-only GGUFs (vendor/llama.cpp/models/ggml-vocab-*.gguf) with their .inp texts and .out
token ids, and llama.cpp's MIT licence, flat into one folder (tests/test_gguf_vocabs.py).

usage: python scripts/llama_vocab.py SDIST.tar.gz OUT_DIR
"""
import sys
import tarfile
from pathlib import Path

MODELS = "/vendor/llama.cpp/models/ggml-vocab-"
LICENSE = "/vendor/llama.cpp/LICENSE"


def main(sdist, out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    count = 0
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if member.isfile() and (MODELS in member.name or member.name.endswith(LICENSE)):
                data = tar.extractfile(member).read()
                (out / Path(member.name).name).write_bytes(data)
                count += 1
    if count < 3:
        sys.exit(f"{sdist}: no llama.cpp vocab test files found")
    (out / ".complete").write_text(f"{count} files from {Path(sdist).name}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
