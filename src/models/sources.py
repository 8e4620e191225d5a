"""Where model tensors come from: a Hugging Face folder, a GGUF file, or a packed packlora folder.

Each source gives tensors by Hugging Face name, one at a time: a float32 numpy array, or a
PackedWeight for tensors that are already quantized (GGUF types of the format registry,
packlora files); and, from its headers alone, how each tensor is stored (`stored_tensors`).
"""
import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..errors import ModelError
from ..quant import BY_GGUF_NAME, PackedWeight, load_packed
from ..quant.halves import bf16_to_float32
from ..quant.io import META_KEY
from ..tokenizer import Tokenizer
from .config import ModelConfig
from .files import HFFolder, has_weights, read_json
from .gguf_file import gguf_name, hf_name, open_gguf, qk_row_order
from .resolve import is_gguf, resolve_source
from .tensors import TensorSpec

PACKED_FILE = "model.packed.safetensors"


def gguf_packed_format(kind, shape):
    """The registry format a GGUF tensor of type `kind` and shape (out, in) stays packed in, or
    None (decoded to float32): F16 / BF16 stay 16-bit where they are rows of whole 32-value
    blocks (linear weights, embeddings), not as norms or biases."""
    fmt = BY_GGUF_NAME.get(kind)
    if fmt is None:
        return None
    if fmt.float16 and (len(shape) != 2 or shape[1] % fmt.layout.elems):
        return None
    return fmt.name


class HFSource:
    def __init__(self, path):
        self.folder = HFFolder(path)
        self.path, self.config = self.folder.path, self.folder.config

    @property
    def tokenizer(self):
        return self.folder.tokenizer

    def names(self):
        return set(self.folder.tensor_names())

    def get(self, name):
        return self.folder.read_tensor(name)

    def shape(self, name):
        return tuple(self.folder.tensor_info(name)[1])

    def stored_tensors(self):
        """{name: TensorSpec}: every tensor is a float array (F32/F16/BF16)."""
        return {n: TensorSpec(n, self.shape(n)) for n in self.folder.tensor_names()}


class GGUFSource:
    """GGUF tensors; quantized ones stay in their format. Q/K rows of llama-layout files are put
    back in Hugging Face's rotate-half order (rows move whole, so packed rows are untouched)."""

    def __init__(self, path):
        self.file = open_gguf(path)
        self.path, self.config = self.file.path, self.file.config
        self._names = {hf_name(n): n for n in self.file.tensor_names() if hf_name(n)}

    @property
    def tokenizer(self):
        return self.file.tokenizer

    def names(self):
        return set(self._names)

    def get(self, name):
        kind, shape, data = self.file.tensor(gguf_name(name))
        order = self._row_order(name, shape[0])
        if gguf_packed_format(kind, shape) is not None:
            # an owned copy of the packed bytes (a memory map would be invisible to the
            # process memory measure the report cross-checks against); F16 / BF16 as bytes
            raw = np.array(data if order is None else data[order]).view(np.uint8)
            return PackedWeight.from_gguf(kind, shape, raw)
        if kind == "BF16":
            arr = bf16_to_float32(np.asarray(data))
        else:
            arr = np.array(data, dtype=np.float32).reshape(shape)
        return arr if order is None else arr[order]

    def shape(self, name):
        return tuple(self.file.tensor(gguf_name(name))[1])

    def stored_tensors(self):
        """{name: TensorSpec} from the GGUF tensor infos (the data stays memory-mapped)."""
        out = {}
        for hf, gguf in self._names.items():
            kind, shape, _ = self.file.tensor(gguf)
            out[hf] = TensorSpec(hf, shape, gguf_packed_format(kind, shape))
        return out

    def _row_order(self, name, rows):
        if not self.file.qk_permuted:
            return None
        cfg = self.config
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            return qk_row_order(rows, cfg.num_heads)
        if name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
            return qk_row_order(rows, cfg.num_kv_heads)
        return None


class PackedSource:
    """A folder written by `packlora quantize`: config.json, tokenizer files and
    model.packed.safetensors holding PackedWeights and float tensors (read on first use)."""

    def __init__(self, path):
        self.path = Path(path)
        self.config = ModelConfig.from_hf(read_json(self.path / "config.json"),
                                          str(self.path / "config.json"))
        self._tensors = None

    @property
    def tensors(self):
        if self._tensors is None:
            self._tensors, _ = load_packed(self.path / PACKED_FILE)
        return self._tensors

    @property
    def tokenizer(self):
        tok_json = self.path / "tokenizer.json"
        if not tok_json.is_file():
            return None
        cfg_path = self.path / "tokenizer_config.json"
        return Tokenizer.from_file(tok_json, read_json(cfg_path) if cfg_path.is_file() else {})

    def names(self):
        return set(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def get(self, name):
        value = self.tensors.pop(name)  # hand it over; the source keeps no second reference
        return value if hasattr(value, "dequantize") else np.asarray(value, dtype=np.float32)

    def stored_tensors(self):
        """{name: TensorSpec} from the file's header: the packlora metadata describes the packed
        weights, the remaining entries (not buffers of those) are float arrays."""
        with safe_open(str(self.path / PACKED_FILE), framework="numpy") as f:
            described = json.loads((f.metadata() or {}).get(META_KEY, "{}"))
            out = {n: TensorSpec(n, tuple(d["shape"]), d["format"], d["block_size"],
                                 d["double_quant"]) for n, d in described.items()}
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if not any(key.startswith(p + ".") for p in described):
                    out[key] = TensorSpec(key, tuple(f.get_slice(key).get_shape()))
        return out


def open_source(path):
    path = Path(path)
    if path.is_dir():
        if (path / PACKED_FILE).is_file():
            return PackedSource(path)
        return HFSource(path)
    if is_gguf(path):
        return GGUFSource(path)
    raise ModelError(f"{path}: not a model folder or a GGUF file")


def load_tokenizer(source):
    """The tokenizer of a model name, a Hugging Face or `packlora quantize` folder, or a GGUF
    file (a vocab-only one too); ModelError when the model carries none."""
    path = resolve_source(source)
    tok = open_gguf(path).tokenizer if path.is_file() else open_source(path).tokenizer
    if tok is None:
        raise ModelError(f"{path}: the model has no tokenizer (tokenizer.json or GGUF "
                         "tokenizer.ggml.* metadata)")
    return tok


def read_header(source):
    """(path, ModelConfig, {name: TensorSpec} as stored, or None) of a model source, read from
    headers alone (no tensor data): a model name, .gguf file, model folder, or a config.json
    path. A config.json, or a folder holding config.json but no weights, gives the config alone."""
    path = Path(source).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        return str(path), ModelConfig.from_hf(read_json(path), str(path)), None
    path = resolve_source(source)
    if path.is_dir():
        cfg_path = path / "config.json"
        if not (path / PACKED_FILE).is_file() and not has_weights(path):
            return str(cfg_path), ModelConfig.from_hf(read_json(cfg_path), str(cfg_path)), None
        src = open_source(path)
        return str(cfg_path), src.config, src.stored_tensors()
    src = open_source(path)
    return str(path), src.config, src.stored_tensors()
