"""safetensors files of packed weights: each buffer stored as `<name>.<buffer>`, plus JSON."""
import json
import os

from safetensors import SafetensorError, safe_open

from ..errors import QuantError
from ..fileio import save_safetensors
from .packed import PackedWeight

META_KEY = "packlora"


def _describe(name, pw):
    return {"format": pw.format, "shape": list(pw.shape), "block_size": pw.block_size,
            "double_quant": pw.double_quant, "buffers": sorted(pw.buffers)}


def _flatten(tensors):
    """{file key: array} (save_safetensors brings each to the host, contiguous) and the JSON
    description of the packed tensors."""
    flat, described = {}, {}
    for name, value in tensors.items():
        if isinstance(value, PackedWeight):
            described[name] = _describe(name, value)
            items = {f"{name}.{key}": buf for key, buf in value.buffers.items()}
        else:
            items = {name: value}
        for key, arr in items.items():
            if key in flat:
                raise QuantError(f"two tensors would be stored under the same key {key!r}")
            flat[key] = arr
    return flat, described


def save_packed(path, tensors, metadata=None):
    """Write {name: PackedWeight | ndarray} to a safetensors file, atomically.

    metadata: optional {str: str} stored in the safetensors header next to the "packlora" key.
    """
    path = os.fspath(path)
    metadata = dict(metadata or {})
    if META_KEY in metadata:
        raise QuantError(f"metadata key {META_KEY!r} is reserved ({path})")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise QuantError(f"safetensors metadata must map str to str; got {key!r}: "
                             f"{type(value).__name__} ({path})")
    flat, described = _flatten(tensors)
    metadata[META_KEY] = json.dumps(described, sort_keys=True)
    save_safetensors(path, flat, metadata)


def _read(path):
    try:
        with safe_open(path, framework="numpy") as handle:
            metadata = dict(handle.metadata() or {})
            arrays = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except FileNotFoundError:
        raise QuantError(f"packed weight file not found: {path}") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise QuantError(f"cannot read packed weight file {path}: it is truncated or corrupt "
                         f"({exc})") from None
    return arrays, metadata


def _rebuild(path, name, desc, arrays):
    try:
        buffers = {key: arrays.pop(f"{name}.{key}") for key in desc["buffers"]}
        return PackedWeight(desc["format"], tuple(desc["shape"]), buffers, desc["block_size"],
                            desc["double_quant"])
    except KeyError as exc:
        raise QuantError(f"{path}: packed tensor {name!r} is missing {exc}") from None
    except QuantError as exc:
        raise QuantError(f"{path}: packed tensor {name!r} is malformed: {exc}") from None


def load_packed(path):
    """Read a file written by save_packed -> ({name: PackedWeight | ndarray}, user metadata)."""
    path = os.fspath(path)
    arrays, metadata = _read(path)
    try:
        described = json.loads(metadata.pop(META_KEY, "{}"))
    except json.JSONDecodeError as exc:
        raise QuantError(f"{path}: the {META_KEY!r} metadata is not valid JSON ({exc})") from None
    if not isinstance(described, dict):
        raise QuantError(f"{path}: the {META_KEY!r} metadata must be a JSON object")
    tensors = {name: _rebuild(path, name, desc, arrays) for name, desc in described.items()}
    tensors.update(arrays)
    return tensors, metadata
