"""Export a model (optionally with an adapter merged in) as a Hugging Face folder, float or
packed, streaming one tensor at a time so peak memory stays near one dense layer."""
from pathlib import Path

import numpy as np

from .adapters.deltas import AdapterDeltas
from .errors import ModelError
from .fileio import atomic_folder, atomic_path, safetensors_header, write_json
from .kernels import quantize as quantize_fn
from .models.identity import base_identity
from .models.resolve import resolve_source
from .models.sources import PACKED_FILE, open_source
from .models.tensors import EMBEDDING_WEIGHTS, PROJECTIONS, model_tensors
from .quant import REGISTRY, save_packed
from .quant.halves import float32_to_bf16

_PROJECTION_WEIGHTS = tuple(f".{p}.weight" for p in PROJECTIONS)
_AS_TRAINED = _PROJECTION_WEIGHTS + EMBEDDING_WEIGHTS  # float weights training may have packed
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ggml")  # not a folder
_DTYPES = {"float32": ("F32", np.float32), "float16": ("F16", np.float16),
           "bfloat16": ("BF16", None)}


def _to_dtype(a, dtype):
    if dtype == "bfloat16":
        return float32_to_bf16(a)
    return np.ascontiguousarray(a, dtype=_DTYPES[dtype][1])


class StreamingSafetensors:
    """Writes a safetensors file whose header is known up front, one tensor at a time."""

    def __init__(self, f, entries, metadata=None):
        sizes = {"F32": 4, "F16": 2, "BF16": 2}
        self.order = [e[0] for e in entries]
        self.f = f
        f.write(safetensors_header([(name, dtype, shape, int(np.prod(shape)) * sizes[dtype])
                                    for name, dtype, shape in entries], metadata))

    def write(self, name, array):
        expected = self.order.pop(0)
        if name != expected:
            raise ValueError(f"tensors must be written in header order: got {name}, "
                             f"want {expected}")
        self.f.write(np.ascontiguousarray(array).data)


def export_model(source, out_dir, adapter=None, dtype="float32", quantize=None,
                 block_size=None, double_quant=None, base_mode=None):
    """Write `source` (+ merged adapter) to out_dir: config.json, tokenizer, and either
    model.safetensors in `dtype` or, with `quantize` set, model.packed.safetensors.
    base_mode: what float linear weights take the adapter on, "float" (W: PEFT's merge) or
    "quantized" (deq(Q(W)), what the adapter was trained against; LoftQ's default).
    The folder appears under its name only when complete; an existing one is refused."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    out = check_new_folder(out_dir)
    src = open_source(resolve_source(source))
    delta = AdapterDeltas(adapter, src.config) if adapter else None
    names = sorted(src.names())
    if delta is not None:
        delta.check_mergeable(src)
        delta.check_base(base_identity(source, src.path, None))  # shapes fit: is it its base?
    as_trained = delta is not None and delta.base_mode(base_mode) == "quantized"
    with atomic_folder(out) as tmp:
        tmp = Path(tmp)
        if quantize:
            _write_packed(src, names, tmp, delta, quantize, block_size, double_quant, as_trained)
        else:
            _write_dense(src, names, tmp, delta, dtype, as_trained)
        hf_cfg = src.config.to_hf_dict()
        if not quantize:
            hf_cfg["torch_dtype"] = dtype  # what model.safetensors holds
        write_json(tmp / "config.json", hf_cfg)
        tok = src.tokenizer
        if tok is not None:
            if delta is not None and delta.chat_template is not None:
                tok.set_chat_template(delta.chat_template, str(delta.path))  # as trained
            tok.save(tmp)
    return out


def check_new_folder(path) -> Path:
    """The output folder, refused when it is a file or a folder with anything in it: a model
    folder (the source's own, an earlier export) is never overwritten or mixed with another's
    files."""
    path = Path(path)
    if path.is_file() or (path.is_dir() and any(path.iterdir())):
        raise ModelError(f"{path}: the output exists; remove it or choose another output folder")
    if path.suffix.lower() in _FILE_SUFFIXES:
        raise ModelError(f"{path}: the output is a folder (config.json, weights, tokenizer), "
                         f"not a {path.suffix} file; give it a folder name (merge writes one "
                         "file only as .gguf)")
    return path


def _float_tensor(src, name, delta, as_trained=False):
    value = src.get(name)
    w = value.dequantize() if hasattr(value, "dequantize") else np.asarray(value, np.float32)
    if as_trained and not hasattr(value, "dequantize") and name.endswith(_AS_TRAINED):
        w = delta.as_trained(w, name)  # the float weight as the training run held it
    path = name.removesuffix(".weight")
    if delta is not None and path in delta.modules:
        w = delta.merged_rows(path, w)
    return w


def _write_dense(src, names, out, delta, dtype, as_trained):
    code = _DTYPES[dtype][0]
    shapes = {n: src.shape(n) for n in names}
    with atomic_path(out / "model.safetensors", ".safetensors") as tmp, open(tmp, "wb") as f:
        writer = StreamingSafetensors(f, [(n, code, shapes[n]) for n in names], {"format": "pt"})
        for n in names:
            writer.write(n, _to_dtype(_float_tensor(src, n, delta, as_trained), dtype))


def _write_packed(src, names, out, delta, fmt, block_size, double_quant, as_trained):
    if double_quant is None:
        double_quant = fmt in REGISTRY and REGISTRY[fmt].double_quant
    quant = {"format": fmt, "double_quant": double_quant,
             **({} if block_size is None else {"block_size": block_size})}
    packed = {t.name: t for t in model_tensors(src.config, quant)
              if t.format}  # a format per tensor (presets pick them; quant.embeddings: auto)
    tensors = {}
    for n in names:
        w = _float_tensor(src, n, delta, as_trained)
        if n in packed:
            t = packed[n]
            w = quantize_fn(w, t.format, block_size=t.block_size, double_quant=t.double_quant,
                            name=n)
        tensors[n] = w
    save_packed(out / PACKED_FILE, tensors, {"format": "packlora"})
