"""Small layers: RMSNorm and token embedding (dense or packed)."""
import numpy as np

from .. import kernels, ops
from ..errors import ModelError
from ..tensor import Tensor
from .module import Module


class RMSNorm(Module):
    def __init__(self, weight: Tensor, eps: float):
        self.weight = weight
        self.eps = float(eps)

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


def gather_packed_rows(w, ids, device):
    """Rows of a packed (V, D) weight for integer ids (...) -> float32 (..., D), one kernel call."""
    xp = device.xp
    flat = xp.asarray(ids).reshape(-1)
    rows = xp.empty((flat.size, w.shape[1]), dtype=np.float32)
    return kernels.gather_rows(w, flat, rows).reshape(*ids.shape, w.shape[1])


class Embedding(Module):
    """Token embedding; its table is a float Tensor or a PackedWeight (decoded per batch of ids)."""

    def __init__(self, weight):
        self.weight = weight
        self.num_embeddings, self.dim = weight.shape

    @property
    def packed(self):
        return not isinstance(self.weight, Tensor)

    def _check_ids(self, low, high):
        if low < 0:
            raise ModelError(f"token id {low} is negative")
        if high >= self.num_embeddings:
            raise ModelError(f"token id {high} has no row in the model's embedding "
                             f"({self.num_embeddings} rows): the tokenizer has more tokens "
                             "than the model")

    def forward(self, ids, device):
        idx = ids.data if isinstance(ids, Tensor) else device.xp.asarray(ids)
        if idx.size:
            self._check_ids(int(idx.min()), int(idx.max()))
        if self.packed:
            return Tensor(gather_packed_rows(self.weight, idx, device), device)
        return ops.embedding(self.weight, idx)
