"""Which base an adapter was trained on: the model as the user named it, the bytes of its weight
files (total size and a digest of samples spread over them), and how it was quantized.

The record goes into the adapter's weights file as safetensors metadata (PEFT and safetensors
ignore metadata keys they do not know; adapter_config.json keeps PEFT's keys only). Reading
17 samples of 64 KiB is instant even for a 13 GB base, and two different files of one size
almost never share them; it is a check against the wrong base, not a cryptographic seal."""
import hashlib
import json
from pathlib import Path

METADATA_KEY = "packlora.base"
_SAMPLES, _SAMPLE_BYTES = 17, 1 << 16


def weight_files(path) -> list[Path]:
    """The files holding a model's tensors: the .gguf itself, or a folder's .safetensors."""
    path = Path(path)
    return [path] if path.is_file() else sorted(path.glob("*.safetensors"))


def _digest(files) -> tuple[int, str]:
    h = hashlib.sha256()
    total = 0
    for f in files:
        size = f.stat().st_size
        total += size
        h.update(size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            for i in range(_SAMPLES):
                fh.seek(max(0, (size - _SAMPLE_BYTES) * i // (_SAMPLES - 1)))
                h.update(fh.read(_SAMPLE_BYTES))
    return total, h.hexdigest()


def base_identity(source_name, path, quant) -> dict:
    """{name, size, sample_sha256, quant} of a base model (quant: models.tensors.quant_spec)."""
    size, digest = _digest(weight_files(path))
    return {"name": str(source_name), "size": size, "sample_sha256": digest,
            "quant": dict(quant or {})}


def identity_metadata(identity) -> dict:
    return {METADATA_KEY: json.dumps(identity, sort_keys=True)}


def recorded_identity(metadata) -> dict | None:
    """The record written by identity_metadata, or None (an adapter from PEFT or older packlora)."""
    raw = (metadata or {}).get(METADATA_KEY)
    try:
        value = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def base_mismatch(recorded, current) -> str | None:
    """Why `current` (a base_identity) is not the base `recorded`, or None when it is (or
    nothing was recorded). Weights are compared by size and samples, not by name."""
    if not recorded:
        return None
    same_bytes = (recorded.get("size"), recorded.get("sample_sha256")) == (
        current["size"], current["sample_sha256"])
    if not same_bytes:
        return (f"was trained on {recorded.get('name')!r} ({_gib(recorded.get('size'))}), "
                f"not on {current['name']!r} ({_gib(current['size'])}): the weights differ")
    fmt_then = (recorded.get("quant") or {}).get("format")
    fmt_now = (current.get("quant") or {}).get("format")
    if fmt_then != fmt_now and current.get("quant"):
        return (f"was trained on {recorded.get('name')!r} held as {fmt_then}, and is now used "
                f"with it held as {fmt_now}")
    return None


def _gib(n):
    if n is None:
        return "size unknown"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
