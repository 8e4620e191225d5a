"""What the process holds beyond its tracked tensors — the interpreter, numpy and its BLAS,
Numba's loaded kernels, allocator slack — so the report can answer "will this fit in my RAM?".

Measured once per machine and software versions: a fresh interpreter trains one step of a tiny
packed LoRA model (every kernel family loaded) and reports its resident bytes minus what the
tracker counts. It runs twice: the first fills Numba's compile cache where it was cold (the
compiler's own memory would otherwise count, ~110 MiB), the second is measured with every kernel
loaded from that cache, as a training run finds them. The result is cached next to the other
per-machine caches.

A merge holds no model, but one that re-quantizes to a K-quant or IQ4 type loads the compiled
searches (kernels.quantize), and the first compiled code a process loads brings Numba's runtime
and LLVM with it (~45 MiB on x86-64 Linux). What that adds to a fresh process is measured the
same way."""
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from .. import kernels, quant
from ..adapters import apply_lora
from ..device import Device
from ..errors import ConfigError
from ..kernels import COMPILED_QUANTIZERS, quantize
from ..models import ModelConfig, load_model, model_tensors
from ..tracker import rss_now
from ..training.optim import AdamW

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


# probe name -> (cache file prefix, what it runs in a fresh interpreter)
_PROBES = {"training": ("process", "a tiny training step"),
           "quantizer": ("kernels", "quantizing a few blocks to each compiled type")}


def _cache_file(probe):
    """One file per probe, machine and software stack (a new numpy, Numba or packlora measures
    anew, and so does a change to the kernels' sources, which a version string may not show),
    and per way of measuring (now: with the kernels loaded from the compile cache)."""
    key = json.dumps(["cached kernels", platform.machine(), platform.processor(), os.cpu_count(),
                      sys.version, *(version(p) for p in ("packlora", "numpy", "numba")),
                      kernel_sources_hash()])
    root = Path(os.environ.get("PACKLORA_CACHE", Path.home() / ".cache" / "packlora"))
    prefix = _PROBES[probe][0]
    return root / f"{prefix}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


@functools.cache
def kernel_sources_hash():
    """The installed kernels' and format registry's sources (the kernels bake its layouts in),
    read once a process."""
    digest = hashlib.sha256()
    for package in (kernels, quant):
        for path in sorted(Path(package.__file__).parent.rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()


def process_overhead_bytes():
    """The untracked bytes of a packlora training process on this machine (cached); None where
    the resident size cannot be read (no /proc)."""
    return _measured("training")


def quantizer_load_bytes():
    """What loading the compiled K-quant and IQ4 searches adds to a fresh packlora process on
    this machine (cached); None where the resident size cannot be read."""
    return _measured("quantizer")


def _measured(probe):
    if rss_now() is None:
        return None
    path = _cache_file(probe)
    if path.is_file():
        return int(json.loads(path.read_text())["bytes"])
    _probe(probe)  # fills the compile cache
    nbytes = _probe(probe)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"bytes": nbytes}))
    return nbytes


def _probe(probe):
    """The probe's bytes, measured in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-m", "packlora.memory.process", probe], check=False,
                          capture_output=True, text=True)
    if proc.returncode:
        raise ConfigError(f"could not measure the process overhead ({_PROBES[probe][1]} in a "
                          f"fresh interpreter failed): {proc.stderr.strip().splitlines()[-1:]}")
    return int(json.loads(proc.stdout.strip().splitlines()[-1])["bytes"])


def _tiny_folder(folder):
    """config.json and random float32 weights of every tensor the loader reads for TINY."""
    rng = np.random.default_rng(0)
    specs = model_tensors(ModelConfig.from_hf(TINY), quant="none")
    save_file({t.name: (rng.standard_normal(t.shape) * 0.05).astype(np.float32) for t in specs},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY))


def measure_in_this_process():
    """One QLoRA step of the tiny model here; RSS minus the tracker's bytes after it."""
    dev = Device.cpu().autodiff()
    with tempfile.TemporaryDirectory(prefix="packlora-process-") as tmp:
        _tiny_folder(Path(tmp))
        model = load_model(tmp, dev, with_tokenizer=False)
    apply_lora(model, {"targets": "all-linear", "rank": 4})
    opt = AdamW(model.trainable())
    ids = np.random.default_rng(1).integers(0, TINY["vocab_size"], (2, 129))
    for m in (ids, ids[:1, :2]):  # the tiled products, then the single-row kernels
        model.target_loss(m[:, :-1], m[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return max(0, rss_now() - dev.memory.total)


def measure_quantizer_load():
    """RSS added here by quantizing a few blocks to each type with a compiled search."""
    x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)  # (N, K)
    before = rss_now()
    for fmt in COMPILED_QUANTIZERS:
        quantize(x, fmt)
    return max(0, rss_now() - before)


if __name__ == "__main__":
    measure = {"training": measure_in_this_process, "quantizer": measure_quantizer_load}
    print(json.dumps({"bytes": measure[sys.argv[1]]()}))
