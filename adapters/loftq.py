"""LoftQ initialisation: A, B from the truncated SVD of the quantization error W - deq(Q(W))."""
import numpy as np

from ..errors import ConfigError
from ..models.sources import open_source
from ..tensor import Tensor


def _float_weight(model, path):
    src = getattr(model, "_loftq_source", None)
    if src is None:
        src = model._loftq_source = open_source(model.source)
    value = src.get(f"{path}.weight")
    if hasattr(value, "dequantize"):
        raise ConfigError(f"lora.init: loftq needs the float weights, but {path}.weight is stored "
                          f"already quantized ({value.format}) in {model.source}; use init: "
                          "kaiming or gaussian, or load a float (Hugging Face) model")
    return value


def loftq_init(model, path, layer):
    """(A (r, in), B (out, r)) with s * B @ A the best rank-r fit of the quantization error."""
    w = layer.weight
    if isinstance(w, Tensor):
        raise ConfigError(f"lora.init: loftq needs a quantized base, but {path} is float "
                          "(quant: none); use init: kaiming")
    err = _float_weight(model, path).astype(np.float64) - w.dequantize()  # (out, in)
    u, s, vt = np.linalg.svd(err, full_matrices=False)
    r = layer.rank
    root = np.sqrt(s[:r] / layer.scale)  # split sqrt(S / scale) between B and A
    b = (u[:, :r] * root).astype(np.float32)
    a = (root[:, None] * vt[:r]).astype(np.float32)
    return a, b
