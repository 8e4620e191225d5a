"""Where model tensors come from: a Hugging Face folder, a GGUF file, or a packed packlora folder.

Each source gives tensors by Hugging Face name, one at a time: a float32 numpy array, or a
PackedWeight for tensors that are already quantized (GGUF types of the format registry,
packlora files).
"""
from pathlib import Path

import numpy as np

from ..errors import ModelError
from ..quant import GGUF_TYPE_NAMES, PackedWeight, load_packed
from ..tokenizer import Tokenizer
from .config import ModelConfig
from .files import HFFolder, read_json
from .gguf_file import gguf_name, hf_name, open_gguf, qk_row_order

PACKED_FILE = "model.packed.safetensors"


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
        if kind in GGUF_TYPE_NAMES:
            # an owned copy of the packed bytes (a memory map would be invisible to the
            # process memory measure the report cross-checks against)
            raw = np.array(data if order is None else data[order])
            return PackedWeight.from_gguf(kind, shape, raw)
        if kind == "BF16":
            from .files import bf16_to_float32
            arr = bf16_to_float32(np.asarray(data))
        else:
            arr = np.array(data, dtype=np.float32).reshape(shape)
        return arr if order is None else arr[order]

    def shape(self, name):
        return tuple(self.file.tensor(gguf_name(name))[1])

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
    model.packed.safetensors holding PackedWeights and float tensors."""

    def __init__(self, path):
        self.path = Path(path)
        self.config = ModelConfig.from_hf(read_json(self.path / "config.json"),
                                          str(self.path / "config.json"))
        self.tensors, _ = load_packed(self.path / PACKED_FILE)
        self._tok_folder = self.path

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


def open_source(path):
    path = Path(path)
    if path.is_dir():
        if (path / PACKED_FILE).is_file():
            return PackedSource(path)
        return HFSource(path)
    if path.suffix.lower() == ".gguf":
        return GGUFSource(path)
    raise ModelError(f"{path}: not a model folder or a .gguf file")
