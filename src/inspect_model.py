"""`packlora inspect`: architecture, parameter count, tensor formats, packed vs dense bytes."""
from collections import Counter

import numpy as np

from .models import load_model
from .tensor import Tensor


def inspect_report(source, quant=None, text=False):
    model = load_model(source, quant=quant, with_tokenizer=False)
    formats, stored, dense = Counter(), 0, 0
    for _, mod in model.named_modules():
        for value in vars(mod).values():
            if isinstance(value, Tensor):
                formats["float32"] += 1
                stored += value.nbytes
                dense += value.nbytes
            elif hasattr(value, "dequantize"):
                formats[value.format] += 1
                stored += value.nbytes
                dense += int(np.prod(value.shape)) * 4
    report = {"source": str(model.source), "architecture": model.config.as_dict(),
              "parameters": model.num_parameters(), "tensor_formats": dict(formats),
              "stored_bytes": stored, "dense_float32_bytes": dense,
              "ratio_stored_to_dense": round(stored / dense, 4)}
    return _text(report) if text else report


def _text(r):
    arch = r["architecture"]
    lines = [f"model: {r['source']}",
             f"architecture: {arch['model_type']}  layers {arch['num_layers']}  hidden "
             f"{arch['hidden_size']}  heads {arch['num_heads']}/{arch['num_kv_heads']}  "
             f"vocab {arch['vocab_size']}",
             f"parameters: {r['parameters']:,}",
             "tensors: " + ", ".join(f"{k} x{v}" for k, v in sorted(r["tensor_formats"].items())),
             f"stored: {r['stored_bytes'] / 2**20:.1f} MiB   as float32: "
             f"{r['dense_float32_bytes'] / 2**20:.1f} MiB   ({r['ratio_stored_to_dense']:.3f}x)"]
    return "\n".join(lines)
