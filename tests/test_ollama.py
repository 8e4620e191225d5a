"""Models pulled with Ollama (`model: ollama:NAME`): a store laid out as Ollama lays out its own
(manifests/<host>/<namespace>/<model>/<tag> naming the GGUF blob blobs/sha256-<hex>, the
layout of ollama's server and types/model/name.go) resolves to the blob, which loads, plans and
merges as the same GGUF under a .gguf name does; what cannot be used is a one-line error."""
import hashlib
import json
import re

import model_factory as mf
import numpy as np
import pytest
from packlora import export_gguf_adapter, load_adapter, load_model, merge, without_autodiff
from packlora.errors import ModelError
from packlora.memory import plan as mem_plan
from packlora.models.resolve import resolve_source
from test_gguf_out import _adapter

MODEL_LAYER = "application/vnd.ollama.image.model"


def _layer(root, data, media_type):
    """A manifest layer whose blob holds `data`, written where Ollama keeps it."""
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def _pull(root, parts, layers):
    """Write the manifest of (host, namespace, model, tag)."""
    path = root.joinpath("manifests", *parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {"mediaType": "application/vnd.docker.container.image.v1+json",
              "digest": "sha256:" + "0" * 64, "size": 2}
    path.write_text(json.dumps({"schemaVersion": 2, "mediaType":
                                "application/vnd.docker.distribution.manifest.v2+json",
                                "config": config, "layers": layers}))


@pytest.fixture()
def store(tmp_path, monkeypatch):
    """(store folder, the GGUF file, its blob) with the model as library/tiny:latest and
    someone/tiny:q8 of registry.ollama.ai."""
    path, _ = mf.write_gguf(tmp_path / "tiny.gguf", "llama", "Q8_0", vocab=True)
    root = tmp_path / "ollama-models"
    model = _layer(root, path.read_bytes(), MODEL_LAYER)
    template = _layer(root, b"{{ .Prompt }}", "application/vnd.ollama.image.template")
    _pull(root, ("registry.ollama.ai", "library", "tiny", "latest"), [model, template])
    _pull(root, ("registry.ollama.ai", "someone", "tiny", "q8"), [model])
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    return root, path, root / "blobs" / model["digest"].replace(":", "-")


def test_an_ollama_name_is_the_blob_it_runs(store, tmp_path):
    root, path, blob = store
    for name in ("ollama:tiny", "ollama:tiny:latest", "ollama:library/tiny",
                 "ollama:registry.ollama.ai/library/tiny:latest", "ollama:someone/tiny:q8"):
        assert resolve_source(name) == blob, name
    ids = np.array([[5, 9, 2, 7]])
    with without_autodiff():
        want = load_model(path, quant="none")(ids).numpy()
        for source in ("ollama:tiny", blob):   # the name, and the blob that has no .gguf suffix
            np.testing.assert_array_equal(load_model(source, quant="none")(ids).numpy(), want)
    by_name, by_path = (mem_plan(m)["plan"]["merge"] for m in ("ollama:tiny", str(path)))
    assert by_name["copy_buffer"] == by_path["copy_buffer"] > 0   # streamed as a GGUF base
    assert by_name["whole_tensor"] == by_path["whole_tensor"] == 0
    _adapter(path, tmp_path / "ad")
    a = merge(path, tmp_path / "ad", tmp_path / "a.gguf", quantize="q8_0")
    b = merge("ollama:tiny", tmp_path / "ad", tmp_path / "b.gguf", quantize="q8_0")
    assert a.read_bytes() == b.read_bytes()


def test_what_ollama_cannot_give_is_one_line(store, tmp_path):
    root, path, blob = store
    adapter = _layer(root, b"GGUF lora", "application/vnd.ollama.image.adapter")
    _pull(root, ("registry.ollama.ai", "library", "tuned", "latest"),
          [_layer(root, path.read_bytes(), MODEL_LAYER), adapter])
    _pull(root, ("registry.ollama.ai", "library", "gone", "latest"),
          [{"mediaType": MODEL_LAYER, "digest": "sha256:" + "1" * 64, "size": 1}])
    _pull(root, ("registry.ollama.ai", "library", "safetensors", "latest"), [])
    (tmp_path / "notes.txt").write_text("not a model")
    for source, words in [
        ("ollama:nope:7b", f"Ollama has no such model in {root} (pull it with `ollama pull "
                           "nope:7b`"),
        ("ollama:tuned", "Ollama applies a LoRA adapter to this model; packlora would train "
                         "its base without it"),
        ("ollama:gone", f"its model file {root / 'blobs' / ('sha256-' + '1' * 64)} is missing"),
        ("ollama:safetensors", "has no GGUF model layer"),
        ("ollama:a/b/c/d", "not an Ollama model name"),
        ("ollama:tiny+Q4_0", "not an Ollama model name"),
        ("ollama:../../tiny", "not an Ollama model name"),
        (str(tmp_path / "notes.txt"), "a model file must be a GGUF file")]:
        with pytest.raises(ModelError) as err:
            resolve_source(source)
        assert words in str(err.value) and "\n" not in str(err.value), source


def test_the_adapter_ollama_applies_is_an_adapter_here(store, tmp_path):
    """A model Ollama built FROM a base with ADAPTER a llama.cpp LoRA GGUF: the name is refused,
    naming the adapter's blob, and that blob (no .gguf name) is an adapter wherever packlora
    takes one, as the file it came from is."""
    root, path, _ = store
    _adapter(path, tmp_path / "ad")
    gguf_adapter = export_gguf_adapter(tmp_path / "ad", tmp_path / "adapter.gguf", model=path)
    layer = _layer(root, gguf_adapter.read_bytes(), "application/vnd.ollama.image.adapter")
    _pull(root, ("registry.ollama.ai", "library", "tuned", "latest"),
          [_layer(root, path.read_bytes(), MODEL_LAYER), layer])
    blob = root / "blobs" / layer["digest"].replace(":", "-")
    with pytest.raises(ModelError, match=re.escape(f"lora.start_from or --adapter: {blob}") + "$"):
        resolve_source("ollama:tuned")
    ids = np.array([[5, 9, 2, 7]])
    with without_autodiff():
        want = load_adapter(load_model(path, quant="none"), gguf_adapter)(ids).numpy()
        got = load_adapter(load_model("ollama:tiny", quant="none"), blob)(ids).numpy()
    np.testing.assert_array_equal(got, want)
