"""`packlora export-gguf`: a PEFT-format LoRA adapter as a llama.cpp adapter GGUF
(`llama-cli --lora adapter.gguf`, `Llama(lora_path=...)`).

llama.cpp's adapter format: metadata general.type = "adapter", adapter.type = "lora",
adapter.lora.alpha (float32); per adapted base tensor `<ggml name>.lora_a` (r, n_in) and
`.lora_b` (n_out, r) in numpy order. llama.cpp scales every module by alpha / r with r read
from that module's lora_b, so what PEFT's scaling says beyond one alpha over r — rsLoRA's
alpha / sqrt(r), per-module alpha_pattern / rank_pattern — is folded into lora_b exactly, and
lora_b's rows follow the base GGUF's Q/K row order."""
import numpy as np
from gguf import GGMLQuantizationType as GGML
from gguf import GGUFValueType

from ..adapters.deltas import AdapterDeltas
from ..adapters.peft_io import check_adapter_path
from ..config import lora_scale
from ..errors import ModelError
from ..models.gguf_file import gguf_name
from ..models.identity import base_identity
from ..quant import BY_GGUF_NAME
from .codec import encode_rows
from .layout import BaseLayout
from .stream import GGUFStream, TensorPlan, check_new_output

OUTTYPES = {"f32": GGML.F32, "f16": GGML.F16, "q8_0": GGML.Q8_0}


def llama_cpp_scale(alpha, rank):
    """The scale llama.cpp gives a LoRA module (llama_adapter_lora_weight::get_scale), float32."""
    return float(np.float32(alpha) / np.float32(rank)) if alpha else 1.0


def written_alpha(deltas):
    """The one alpha the file carries: the adapter's own scale times its own r, so modules
    at the adapter's r and alpha need no folding (rsLoRA: alpha·sqrt(r))."""
    lora = deltas.lora
    return float(lora_scale(lora.alpha, lora.rank, lora.use_rslora) * lora.rank)


def _refuse_unrepresentable(deltas, adapter):
    if deltas.has_dora:
        raise ModelError(f"{adapter}: a DoRA adapter (lora_magnitude_vector) has no llama.cpp "
                         "adapter form; merge it instead: packlora merge --model M --adapter "
                         f"{adapter} --out model.gguf")
    if not deltas.modules:
        raise ModelError(f"{adapter}: the adapter holds no lora_A / lora_B tensors")


def adapter_tensors(deltas, base, alpha):
    """[(ggml name, float32 array)] of the adapter in llama.cpp's form."""
    deltas.check_mergeable(base.source)
    out = []
    for path, (a, b, _) in sorted(deltas.modules.items()):
        hf = f"{path}.weight"
        ratio = deltas.scale(path) / llama_cpp_scale(alpha, a.shape[0])
        b_out = b if ratio == 1.0 else (b * np.float32(ratio)).astype(np.float32)
        rows = base.gguf_rows(hf, b.shape[0])
        if rows is not None:
            b_out = b_out[rows]
        name = gguf_name(hf)
        out += [(f"{name}.lora_a", a), (f"{name}.lora_b", b_out)]
    return out


def _encode(array, ggml_type, name):
    """(bytes-like array, the type actually used): Q8_0 needs rows of whole 32-blocks; other
    rows (lora_b's, r values long) are stored as F16, as llama.cpp's converter does."""
    if ggml_type == GGML.Q8_0 and array.shape[-1] % BY_GGUF_NAME["Q8_0"].layout.elems:
        ggml_type = GGML.F16
    return encode_rows(ggml_type, array, name), ggml_type


def export_gguf_adapter(adapter, out, model=None, outtype="f32"):
    """Write the PEFT-format adapter folder `adapter` as a llama.cpp adapter GGUF at `out`.
    model: the base (name, HF folder or .gguf) the adapter will run on; default: the one its
    adapter_config.json names. outtype: f32, f16 or q8_0. Returns the output path."""
    if outtype not in OUTTYPES:
        raise ModelError(f"--outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    if check_adapter_path(adapter) is None:
        raise ModelError(f"{adapter}: already a llama.cpp LoRA GGUF")
    out = check_new_output(out)
    deltas = AdapterDeltas(adapter)
    _refuse_unrepresentable(deltas, adapter)
    model = model or deltas.config.get("base_model_name_or_path")
    if not model:
        raise ModelError(f"{adapter}: adapter_config.json names no base model; pass --model")
    base = BaseLayout.open(model)
    alpha = written_alpha(deltas)
    tensors = [(n, a.shape, *_encode(a, OUTTYPES[outtype], n))
               for n, a in adapter_tensors(deltas, base, alpha)]
    deltas.check_base(base_identity(model, base.path, None))  # shapes fit: is it its base?
    kv = [("general.type", "adapter", GGUFValueType.STRING, None),
          ("adapter.type", "lora", GGUFValueType.STRING, None),
          ("adapter.lora.alpha", alpha, GGUFValueType.FLOAT32, None)]
    plans = [TensorPlan(n, shape, kind) for n, shape, _, kind in tensors]
    with GGUFStream(out, base.arch, kv, plans) as f:
        for name, _, data, _ in tensors:
            f.write(name, data)
    return out
