"""LoftQ initialisation: a quantized base Q and A, B such that deq(Q) + s·B·A fits the float W.

One iteration (LoftQ's paper and PEFT): Q = quantize(res), then A, B from the truncated SVD of
W - deq(Q), then res = W - s·B·A; the first res is W. With one iteration Q is the base packlora
loaded, Q(W); with more, Q changes too and replaces the loaded base weight, so a merge into
"the base it was trained against" replays the same iterations (adapters.deltas)."""
import numpy as np

from ..errors import ConfigError
from ..kernels import quantize
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


def fit_workspace_bytes(n, k, iters=1):
    """Bytes loftq_fit holds at its peak for an (n, k) weight: the float source, its float64
    copy and error, the SVD's input copy, U (n, m) and Vt (m, k) in float64, LAPACK's gesdd
    work (about 4 m^2 doubles), and with more than one iteration the residual and its
    quantization (measured with tracemalloc: 36-57 bytes per weight for m = min(n, k))."""
    m = min(n, k)
    per_weight = 28 + (17 if iters > 1 else 0)
    return n * k * per_weight + 8 * (n * m + m * k) + 8 * 4 * m * m


def loftq_fit(w, quant, rank, scale, iters, name="weight"):
    """(A (r, in), B (out, r), Q PackedWeight) for float weight w (out, in): `iters` LoftQ
    alternations in the format quant = {format, block_size, double_quant}."""
    w64 = np.asarray(w, dtype=np.float64)
    res = w
    for _ in range(iters):
        q = quantize(np.asarray(res, np.float32), quant["format"], name=name,
                     block_size=quant.get("block_size"),
                     double_quant=bool(quant.get("double_quant")))
        u, s, vt = np.linalg.svd(w64 - q.dequantize(), full_matrices=False)  # (out, m), (m, in)
        root = np.sqrt(s[:rank] / scale)  # split sqrt(S / scale) between B and A
        b, a = u[:, :rank] * root, root[:, None] * vt[:rank]
        res = w64 - scale * (b @ a)
    return a.astype(np.float32), b.astype(np.float32), q


def loftq_init(model, path, layer, iters=1):
    """(A, B) of `layer` from LoftQ; with iters > 1 its packed base weight is replaced by the
    one LoftQ chose."""
    w = layer.weight
    if isinstance(w, Tensor):
        raise ConfigError(f"lora.init: loftq needs a quantized base, but {path} is float "
                          "(quant: none); use init: kaiming")
    quant = {"format": w.format, "block_size": w.block_size, "double_quant": w.double_quant}
    a, b, q = loftq_fit(_float_weight(model, path), quant, layer.rank, layer.scale, iters,
                        f"{path}.weight")
    if iters > 1:
        layer.base.weight = q.to_device(model.device)
    return a, b
