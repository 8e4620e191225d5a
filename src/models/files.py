"""Read a Hugging Face model folder: config, tokenizer, safetensors streamed tensor by tensor."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..errors import ModelError
from ..quant.halves import bf16_to_float32
from ..tokenizer import Tokenizer, read_chat_template
from .config import ModelConfig

_NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
                 "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
                 "U8": np.uint8, "BOOL": np.bool_}
_MAX_HEADER = 100 * 1024 * 1024
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


def read_json(path: Path) -> dict:
    """A JSON file as a dict; missing or malformed is a ModelError naming the file."""
    if not path.is_file():
        raise ModelError(f"{path}: file not found")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(tensor entries by name, byte offset where the data starts); checks the file is whole."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise ModelError(f"{path}: truncated or corrupt safetensors header ({n} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelError(f"{path}: corrupt safetensors header: {e}") from None
    header.pop("__metadata__", None)
    start = 8 + n
    for name, entry in header.items():
        _check_entry(path, name, entry, size - start)
    return header, start


def _check_entry(path: Path, name: str, entry: dict, data_bytes: int) -> None:
    dtype, shape = entry.get("dtype"), entry.get("shape")
    begin, end = entry.get("data_offsets", (0, -1))
    if dtype not in _NUMPY_DTYPES:
        raise ModelError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
    want = int(np.prod(shape, dtype=np.int64)) * np.dtype(_NUMPY_DTYPES[dtype]).itemsize
    if end - begin != want or begin < 0:
        raise ModelError(f"{path}: tensor {name!r} is corrupt: offsets {begin}..{end} do not "
                         f"hold {dtype}{list(shape)}")
    if end > data_bytes:
        raise ModelError(f"{path}: file is truncated: tensor {name!r} needs bytes up to {end} "
                         f"but the data section has {data_bytes}")


def has_weights(folder: Path) -> bool:
    """Whether a Hugging Face folder holds safetensors weights (one file or a sharded index)."""
    return (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()


class HFFolder:
    """A Hugging Face model folder: config.json, tokenizer files and (sharded) safetensors."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelError(f"{self.path}: model folder not found")
        self.config = ModelConfig.from_hf(read_json(self.path / "config.json"),
                                          str(self.path / "config.json"))
        self._tokenizer = None
        self._headers: dict[Path, tuple[dict, int]] = {}
        self._shards = self._find_shards()  # name -> shard file

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self):
        """The folder's tokenizer, or None when it has no tokenizer.json (weights-only folder)."""
        if not (self.path / "tokenizer.json").is_file():
            return None
        cfg_path = self.path / "tokenizer_config.json"
        cfg = read_json(cfg_path) if cfg_path.is_file() else {}
        jinja = self.path / "chat_template.jinja"
        from_jinja = cfg.get("chat_template") is None and jinja.is_file()
        if from_jinja:
            cfg["chat_template"] = read_chat_template(jinja)
        tok = Tokenizer.from_file(self.path / "tokenizer.json", cfg,
                                  str(jinja) if from_jinja else None)
        gen_path = self.path / "generation_config.json"
        if gen_path.is_file():
            tok.add_eos_ids(read_json(gen_path).get("eos_token_id"), str(gen_path))
        return tok

    def _find_shards(self) -> dict[str, Path]:
        single, index = self.path / SINGLE_FILE, self.path / INDEX_FILE
        if single.is_file():
            return {name: single for name in self._header(single)[0]}
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelError(f"{index}: no 'weight_map' object")
            shards = {name: self.path / f for name, f in weight_map.items()}
            for f in sorted(set(shards.values())):
                if not f.is_file():
                    raise ModelError(f"{f}: safetensors shard listed in {index.name} not found")
            return shards
        raise ModelError(f"{self.path}: no model.safetensors or model.safetensors.index.json")

    def _header(self, shard: Path) -> tuple[dict, int]:
        if shard not in self._headers:
            self._headers[shard] = read_safetensors_header(shard)
        return self._headers[shard]

    def tensor_names(self) -> list[str]:
        return list(self._shards)

    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype, shape) without reading the data."""
        entry = self._entry(name)
        return entry["dtype"], tuple(entry["shape"])

    def _entry(self, name: str) -> dict:
        shard = self._shards.get(name)
        if shard is None:
            raise ModelError(f"{self.path}: no tensor named {name!r}")
        header = self._header(shard)[0]
        if name not in header:
            raise ModelError(f"{shard}: tensor {name!r} (listed in the index) is missing")
        return header[name]

    def read_tensor(self, name: str) -> np.ndarray:
        """One tensor as a float32 array (bf16 and f16 converted)."""
        for _, array in self.iter_tensors([name]):
            return array

    def iter_tensors(self, names=None):
        """Yield (name, float32 array) one tensor at a time, shard by shard."""
        wanted = self.tensor_names() if names is None else list(names)
        by_shard: dict[Path, list[str]] = {}
        for name in wanted:
            self._entry(name)
            by_shard.setdefault(self._shards[name], []).append(name)
        for shard, shard_names in by_shard.items():
            try:
                handle = safe_open(str(shard), framework="numpy")
            except Exception as e:  # noqa: BLE001 - any failure means a bad file
                raise ModelError(f"{shard}: cannot open safetensors file: {e}") from None
            with handle as f:
                for name in shard_names:
                    yield name, self._read(shard, f, name)

    def _read(self, shard: Path, handle, name: str) -> np.ndarray:
        entry = self._entry(name)
        if entry["dtype"] == "BF16":  # numpy has no bfloat16: read the raw bits
            start = self._header(shard)[1]
            begin = entry["data_offsets"][0]
            shape = tuple(entry["shape"])
            bits = np.memmap(shard, dtype=np.uint16, mode="r", offset=start + begin,
                             shape=shape or (1,))
            return bf16_to_float32(np.asarray(bits)).reshape(shape)
        try:
            return np.asarray(handle.get_tensor(name), dtype=np.float32)
        except Exception as e:  # noqa: BLE001 - any failure means a bad file
            raise ModelError(f"{shard}: cannot read tensor {name!r}: {e}") from None
