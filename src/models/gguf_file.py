"""Read a GGUF model file: metadata, config, tokenizer and memory-mapped tensors (no copies)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType

from ..errors import ModelError
from ..quant import GGUF_TYPE_NAMES
from ..tokenizer import Tokenizer
from .config import ModelConfig

# Float types are read as arrays; the quantized ones the format registry keeps packed.
SUPPORTED_TENSOR_TYPES = ("F32", *GGUF_TYPE_NAMES)  # the registry names F16 and BF16 too
# ggml tensor names (per block after "blk.N.") <-> Hugging Face names (after "model.layers.N.")
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_NO_HF_NAME = ("rope_freqs.weight",)  # llama.cpp-only tensors folded into the config
_HF_BLOCK = {v: k for k, v in _BLOCK_NAMES.items()}
_HF_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}
# Architectures whose GGUF Q/K rows are in llama.cpp's interleaved order: llama.cpp rotates them
# in adjacent pairs, so its HF converter permutes those rows (Qwen2/Qwen3 rotate halves, as HF).
QK_PERMUTED_ARCHS = ("llama", "mistral")
# Hugging Face model_type -> the GGUF architecture llama.cpp's converter writes for it
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_GGUF_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_HF_RE = re.compile(r"model\.layers\.(\d+)\.([\w.]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a ggml tensor name (None for llama.cpp-only tensors)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _NO_HF_NAME:
        return None
    m = _GGUF_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise ModelError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def gguf_name(hf: str) -> str:
    """The ggml tensor name of a Hugging Face tensor name."""
    if hf in _HF_GLOBAL:
        return _HF_GLOBAL[hf]
    m = _HF_RE.match(hf)
    if m and m.group(2) in _HF_BLOCK:
        return f"blk.{m.group(1)}.{_HF_BLOCK[m.group(2)]}.{m.group(3)}"
    raise ModelError(f"tensor {hf!r} has no known GGUF name")


def qk_row_order(n_rows: int, n_head: int) -> np.ndarray:
    """Row indices that undo llama.cpp's Q/K permutation: hf_rows = gguf_rows[order].

    The HF->GGUF converter stores W[perm] with perm = arange(n).reshape(n_head, 2, d/2)
    .swapaxes(1, 2).ravel() (rotary pairs interleaved); the inverse permutation restores
    the rotate-half order. Pass the head count of that projection (n_kv_heads for K).
    Works on packed rows, since a row's blocks stay whole.
    """
    if n_rows % (2 * n_head):
        raise ModelError(f"cannot unpermute {n_rows} rows into {n_head} heads of even size")
    perm = np.arange(n_rows).reshape(n_head, 2, n_rows // n_head // 2).swapaxes(1, 2).ravel()
    return np.argsort(perm)


class _FastReader(GGUFReader):
    """GGUFReader slicing a plain ndarray view of its memmap (numpy.memmap slices are slow)."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


class GGUFModelFile:
    """An opened GGUF file: `.fields`, `.config`, `.tokenizer`, and its tensors by ggml name."""

    def __init__(self, path: Path, reader):
        self.path = path
        self._reader = reader
        self.fields, self._types = _plain_fields(reader, path)
        reader.fields.clear()  # its per-string arrays: ~70 MiB for a 49k-token vocabulary
        self._tensors = {t.name: t for t in reader.tensors}
        self._check_tensor_sizes()
        self._config = None
        self._tokenizer = None

    @property
    def architecture(self) -> str:
        return self.fields.get("general.architecture", "")

    @property
    def qk_permuted(self) -> bool:
        """True if Q/K rows are in llama.cpp's interleaved order (see qk_row_order)."""
        return self.architecture in QK_PERMUTED_ARCHS

    @property
    def config(self) -> ModelConfig:
        if self._config is None:
            if self.fields.get("general.type") == "adapter":
                raise ModelError(f"{self.path}: a LoRA adapter GGUF, not a model; give its base "
                                 "model as the model (llama.cpp runs the two with --lora)")
            cfg = ModelConfig.from_gguf(self.fields, str(self.path), self.tensor_names())
            if "rope_freqs.weight" in self._tensors:
                factors = self.tensor("rope_freqs.weight")[2].astype(np.float64).tolist()
                cfg.rope_scaling = {"rope_type": "freq_factors", "factors": factors}
            self._config = cfg
        return self._config

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if "tokenizer.ggml.model" not in self.fields:
                return None  # a weights-only file: the model loads without a tokenizer
            self._tokenizer = Tokenizer.from_gguf(self.fields, str(self.path))
        return self._tokenizer

    def typed_fields(self):
        """[(key, value, GGUFValueType, array element type or None)] of every metadata key, in
        file order, values as read (what a GGUF writer needs to copy them)."""
        return [(key, self.fields[key], *kinds) for key, kinds in self._types.items()
                if not key.startswith("GGUF.")]  # the reader's view of the header

    def tensor_location(self, name: str) -> tuple[int, int]:
        """(absolute byte offset, byte count) of a tensor's data in the file."""
        t = self._get(name)
        return int(t.data_offset), int(t.n_bytes)

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        return self._get(name).tensor_type.name

    def tensor(self, name: str) -> tuple[str, tuple[int, ...], np.ndarray]:
        """(type name, logical shape in (out, in) order, data view without copy).

        Quantized data is uint8 (rows, bytes per row); F32/F16 are (out, in) arrays of that
        dtype; BF16 is a uint16 (out, in) view of the raw bits.
        """
        t = self._get(name)
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TENSOR_TYPES:
            raise ModelError(f"{self.path}: tensor {name!r} has type {kind}, which is not "
                             f"supported (supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists ne0 (columns) first
        data = t.data
        if kind == "BF16":
            data = data.view(np.uint16).reshape(shape)
        return kind, shape, data

    def _get(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelError(f"{self.path}: no tensor named {name!r}") from None

    def _check_tensor_sizes(self) -> None:
        for t in self._reader.tensors:
            if int(t.data.nbytes) != int(t.n_bytes):
                raise ModelError(f"{self.path}: file is truncated or corrupt: tensor {t.name!r} "
                                 f"has {t.data.nbytes} of its {t.n_bytes} bytes")


def open_gguf(path) -> GGUFModelFile:
    """Memory-map a GGUF file; a missing, truncated or corrupt file is a ModelError."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: GGUF file not found")
    try:
        reader = _FastReader(str(path))
    except Exception as e:  # noqa: BLE001 - any failure means a bad file
        raise ModelError(f"{path}: not a valid GGUF file (truncated or corrupt): "
                         f"{type(e).__name__}: {e}") from None
    return GGUFModelFile(path, reader)


def _plain_fields(reader, path: Path) -> tuple[dict, dict]:
    """Metadata as plain python values (strings decoded, arrays as lists), and each key's
    (GGUFValueType, array element type or None)."""
    out, types = {}, {}
    for key, field in reader.fields.items():
        try:
            value = field.contents()
        except Exception as e:  # noqa: BLE001 - any failure means a bad file
            raise ModelError(f"{path}: cannot decode GGUF metadata key {key!r}: {e}") from None
        if isinstance(value, np.generic):
            value = value.item()
        if field.types == [GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
        out[key] = value
        kind = field.types[0] if field.types else None
        types[key] = (kind, field.types[-1] if kind == GGUFValueType.ARRAY else None)
    return out, types
