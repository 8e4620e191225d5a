"""A llama.cpp LoRA adapter GGUF (`llama-cli --lora`, what `export-gguf` and llama.cpp's
convert_lora_to_gguf.py write) read in the PEFT form the rest of packlora uses.

The file: metadata general.type = "adapter", adapter.type = "lora", adapter.lora.alpha; per
adapted base tensor `<ggml name>.lora_a` (r, n_in) and `.lora_b` (n_out, r) in numpy order, in
F32, F16, BF16 or Q8_0. llama.cpp scales each module by alpha / r (1 where alpha is 0) with r
that module's own, which is PEFT's lora_alpha over r with a rank_pattern for other ranks. The
rows of lora_b follow the base GGUF's Q/K order, put back in Hugging Face's here, which needs
the base's head counts."""
import math
import re
from collections import Counter

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ..errors import ModelError
from ..models.gguf_file import GGUF_ARCH, QK_PERMUTED_ARCHS, hf_name, open_gguf, qk_row_order
from ..quant.halves import bf16_to_float32

SUFFIXES = {".lora_a": "lora_A", ".lora_b": "lora_B"}


def is_adapter_gguf(path):
    """Whether `path` is a GGUF file that says it is an adapter (general.type)."""
    return open_gguf(path).fields.get("general.type") == "adapter"


def read_gguf_lora(path, base_config):
    """(PEFT adapter_config dict, {"<module path>.lora_A.weight" | ".lora_B.weight": float32
    array in Hugging Face row order}) of a llama.cpp LoRA GGUF; `base_config` (a ModelConfig)
    gives the head counts of the Q/K rows."""
    f = open_gguf(path)
    fields = f.fields
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise ModelError(f"{path}: not a llama.cpp LoRA adapter GGUF (general.type "
                         f"{fields.get('general.type')!r}, adapter.type "
                         f"{fields.get('adapter.type')!r})")
    if fields.get("adapter.alora.invocation_tokens") is not None:
        raise ModelError(f"{path}: an activated LoRA (aLoRA), which applies only after its "
                         "invocation tokens; packlora's adapters apply everywhere")
    if f.architecture != GGUF_ARCH.get(base_config.model_type):
        raise ModelError(f"{path}: an adapter for a {f.architecture!r} model, and the base is "
                         f"{base_config.model_type!r} ({GGUF_ARCH.get(base_config.model_type)!r} "
                         "in GGUF)")
    tensors = {}
    for name in f.tensor_names():
        module, part = _module(path, name)
        kind, _, data = f.tensor(name)
        value = _as_float32(kind, data)
        if part == "lora_B":
            value = _hf_rows(module, value, f.architecture, base_config)
        tensors[f"{module}.{part}.weight"] = value
    ranks = _ranks(path, tensors)
    return _peft_config(_alpha(path, fields), ranks), tensors


def _alpha(path, fields):
    """adapter.lora.alpha: 0 (or none) means a scale of 1, as llama.cpp takes it."""
    alpha = fields.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) \
            or not math.isfinite(alpha) or alpha < 0:
        raise ModelError(f"{path}: adapter.lora.alpha must be a finite number >= 0 (0: a scale "
                         f"of 1), got {alpha!r}")
    return alpha


def _module(path, name):
    """(Hugging Face module path, "lora_A" | "lora_B") of an adapter tensor name."""
    for suffix, part in SUFFIXES.items():
        if name.endswith(suffix):
            hf = hf_name(name[:-len(suffix)])
            if hf is None or not hf.endswith(".weight") or hf == "model.embed_tokens.weight":
                raise ModelError(f"{path}: tensor {name!r} adapts a tensor packlora has no "
                                 "LoRA layer for (its adapters sit on linear layers)")
            return hf[:-len(".weight")], part
    raise ModelError(f"{path}: tensor {name!r} is not a LoRA tensor (.lora_a / .lora_b)")


def _as_float32(kind, data):
    if kind == "F32":
        return np.array(data, dtype=np.float32)
    if kind == "F16":
        return np.asarray(data).astype(np.float32)
    if kind == "BF16":
        return bf16_to_float32(np.asarray(data))
    return dequantize(np.asarray(data), GGMLQuantizationType[kind]).astype(np.float32)


def _hf_rows(module, b, arch, config):
    """lora_b (n_out, r) with Q/K rows in Hugging Face's order."""
    if arch not in QK_PERMUTED_ARCHS:
        return b
    if module.endswith("self_attn.q_proj"):
        return b[qk_row_order(b.shape[0], config.num_heads)]
    if module.endswith("self_attn.k_proj"):
        return b[qk_row_order(b.shape[0], config.num_kv_heads)]
    return b


def _ranks(path, tensors):
    """{module path: r}, each module with lora_A (r, in) and lora_B (out, r) of one r."""
    ranks = {}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key[:-len(".lora_A.weight")]
            b = tensors.get(f"{module}.lora_B.weight")
            if b is None or b.shape[1] != a.shape[0]:
                raise ModelError(f"{path}: {module} needs .lora_a (r, in) and .lora_b (out, r) "
                                 "of the same r")
            ranks[module] = a.shape[0]
    if not ranks or len(ranks) * 2 != len(tensors):
        raise ModelError(f"{path}: every .lora_b needs its .lora_a, and the file at least one")
    return ranks


def _peft_config(alpha, ranks):
    """The PEFT adapter_config of llama.cpp's scale alpha / r (1 for alpha 0) per module."""
    r = Counter(ranks.values()).most_common(1)[0][0]
    rank_pattern = {m: k for m, k in ranks.items() if k != r}
    alpha_pattern = {} if alpha else {m: k for m, k in ranks.items() if k != r}
    return {"peft_type": "LORA", "r": r, "lora_alpha": float(alpha) if alpha else float(r),
            "target_modules": "|".join(re.escape(m) for m in sorted(ranks)),  # these, no more
            "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern}
