"""Products with a frozen base weight (float Tensor or PackedWeight) and the packed matmul node."""
from .. import kernels
from ..autodiff import Function
from ..tensor import Tensor


def frozen_fwd(x, w, device):
    """x (M, K) @ W.T for a frozen weight W (N, K): a float Tensor or a PackedWeight."""
    if isinstance(w, Tensor):
        return x @ w.data.T
    return kernels.linear_fwd(x, w, device=device)


def frozen_bwd(g, w, device):
    """g (M, N) @ W for a frozen weight W (N, K): a float Tensor or a PackedWeight."""
    if isinstance(w, Tensor):
        return g @ w.data
    return kernels.linear_bwd(g, w, device=device)


class PackedMatmul(Function):
    """y = x @ W.T (+ bias) with W packed. Saves only the packed weight; returns dx (and dbias)."""

    def forward(self, x, bias, weight=None, value=True):
        """value=False: the output's value is never read (a checkpoint's recompute of its
        block's last product, see DecoderLayer.recompute): zeros instead of the product."""
        self.weight = weight
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        if x2.dtype != self.xp.float32:
            x2 = x2.astype(self.xp.float32)
        if not value:
            y = self.xp.zeros((x2.shape[0], weight.shape[0]), self.xp.float32)
        else:
            y = kernels.linear_fwd(self.xp.ascontiguousarray(x2), weight, device=self.device)
        if bias is not None:
            y += bias
        self.in_dtype = x.dtype
        return y.reshape(*lead, y.shape[-1])

    def backward(self, g):
        g2 = self.xp.ascontiguousarray(g.reshape(-1, g.shape[-1]), dtype=self.xp.float32)
        dx = None
        if self.needs[0]:
            dx = kernels.linear_bwd(g2, self.weight, device=self.device)
            dx = dx.reshape(*g.shape[:-1], dx.shape[-1]).astype(self.in_dtype, copy=False)
        db = g2.sum(axis=0) if self.needs[1] else None
        return dx, db
