"""Models pulled with Ollama, by name: `ollama:llama3.2:1b` is the GGUF file `ollama run
llama3.2:1b` runs.

Ollama's store (its OLLAMA_MODELS folder, ~/.ollama/models by default) keeps one manifest per
name at manifests/<host>/<namespace>/<model>/<tag>; a name is [host/][namespace/]model[:tag],
the defaults registry.ollama.ai, library and latest, each part of letters, digits, _ . and -
(ollama types/model/name.go). The manifest's layer of media type
application/vnd.ollama.image.model is the GGUF, stored as blobs/sha256-<hex> for its digest
sha256:<hex>."""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import ModelError
from .files import read_json

PREFIX = "ollama:"
DEFAULTS = ("registry.ollama.ai", "library")  # host, namespace
DEFAULT_TAG = "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"
ADAPTER_LAYER = "application/vnd.ollama.image.adapter"


def store() -> Path:
    """The folder Ollama keeps its models in."""
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def manifest_path(root: Path, name: str) -> Path:
    """Where Ollama keeps the manifest of `name` ([host/][namespace/]model[:tag])."""
    *scope, model = name.split("/")
    model, _, tag = model.partition(":")
    parts = (*scope, model, tag or DEFAULT_TAG)
    if len(scope) > 2 or ".." in name or not all(re.fullmatch(r"[\w.-]+", p) for p in parts):
        raise ModelError(f"{PREFIX}{name}: not an Ollama model name ([host/][namespace/]"
                         "model[:tag], e.g. ollama:llama3.2:1b)")
    return root.joinpath("manifests", *DEFAULTS[:2 - len(scope)], *parts)


def ollama_model(name: str) -> Path:
    """The GGUF blob of the Ollama model `name`, or a ModelError that says what is missing."""
    root = store()
    manifest = manifest_path(root, name)
    if not manifest.is_file():
        raise ModelError(f"{PREFIX}{name}: Ollama has no such model in {root} (pull it with "
                         f"`ollama pull {name}`; OLLAMA_MODELS names another store)")
    layers = read_json(manifest).get("layers")
    if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
        raise ModelError(f"{manifest}: an Ollama manifest lists its layers; this one has none")
    by_type = {layer.get("mediaType"): layer for layer in layers}
    if ADAPTER_LAYER in by_type:
        raise ModelError(f"{PREFIX}{name}: Ollama applies a LoRA adapter to this model; "
                         "packlora would train its base without it: give the base model (the "
                         "FROM of its Modelfile) and this adapter as lora.start_from or "
                         f"--adapter: {_blob(root, by_type[ADAPTER_LAYER])}")
    if MODEL_LAYER not in by_type:
        raise ModelError(f"{PREFIX}{name}: the manifest {manifest} has no GGUF model layer "
                         f"({MODEL_LAYER})")
    blob = _blob(root, by_type[MODEL_LAYER])
    if not blob.is_file():
        raise ModelError(f"{PREFIX}{name}: its model file {blob} is missing (pull it again "
                         f"with `ollama pull {name}`)")
    return blob


def _blob(root: Path, layer: dict) -> Path:
    return root / "blobs" / str(layer.get("digest", "")).replace(":", "-")
