"""The LoRA (and DoRA) product on a frozen linear layer, as one fused tape node.

y = base(x) + s * (drop(x) @ A.T) @ B.T            (LoRA)
y = W x + (f - 1) * W x' + f * s * B A x' + bias,  (DoRA, PEFT's form: f = m / ||W + s*B*A||_row,
    x' = drop(x)                                    held constant in backward as the DoRA paper
                                                    and PEFT do; without dropout f*(Wx + sBAx))
The base weight is a PackedWeight (never expanded) or a frozen float Tensor.
"""
import numpy as np

from .. import kernels
from ..autodiff import Function, may_remake
from ..tensor import Tensor
from .linear import frozen_bwd, frozen_fwd


class LoraMatmul(Function):
    """Inputs: x (..., K), A (r, K), B (N, r), magnitude (N,) or None, bias (N,) or None."""

    def forward(self, x, a, b, mag, bias, weight=None, scale=1.0, dropout=0.0, norm=None,
                value=True):
        """value=False: the output's value is never read (PackedMatmul.forward), so LoRA skips
        both products; what backward needs is saved as always (DoRA computes it anyway)."""
        xp = self.xp
        lead = x.shape[:-1]
        x2 = xp.ascontiguousarray(x.reshape(-1, x.shape[-1]))  # (M, K)
        xd, mask = x2, None
        if dropout > 0.0:
            mask = (self.device.rng.random(x2.shape, dtype=np.float32) >= dropout)
            xd = x2 * mask * np.float32(1.0 / (1.0 - dropout))
        xa = xd @ a.T  # (M, r)
        factor = None
        if mag is None and not value:
            y = xp.zeros((x2.shape[0], b.shape[0]), np.float32)
        elif mag is None:
            y = frozen_fwd(x2, weight, self.device)  # (M, N)
            kernels.add_product(y, xa * np.float32(scale), b.T, self.device)
        else:
            factor = mag / norm  # (N,)
            pre = frozen_fwd(xd, weight, self.device)  # (M, N): W x'
            # PEFT's form: the base sees x itself; W x - W x' vanishes without dropout
            y = None if mask is None else frozen_fwd(x2, weight, self.device) - pre
            kernels.add_product(pre, xa * np.float32(scale), b.T, self.device)  # + s B A x'
            if self.needs[3]:  # needed for the magnitude's gradient
                self.pre = self.device.memory.track(pre)
            y = pre * factor if y is None else y + pre * factor
        if bias is not None:
            y += bias
        self.weight, self.scale, self.dropout, self.factor = weight, scale, dropout, factor
        self.norm = norm
        self.in_dtype = x.dtype
        # A's gradient reads x' = x: kept, or remade by the op that made x (see Function)
        src = self.parents[0] if self.parents else None
        remade = mask is None and self.needs[1] and may_remake(src)
        self.x_from = src if remade else None
        keep = self.needs[1] and self.x_from is None
        self.save(xd if keep else None, xa if self.needs[2] else None, a, b, mask)
        return y.reshape(*lead, y.shape[-1])

    def backward(self, g):
        xd, xa, a, b, mask = self.saved
        xp, s = self.xp, self.scale
        if self.x_from is not None:
            xd = self.x_from.remake()
            xd = xd.reshape(-1, xd.shape[-1])  # (M, K)
        g2 = xp.ascontiguousarray(g.reshape(-1, g.shape[-1]))  # (M, N)
        dmag = gf = None
        if self.factor is not None:
            if self.needs[3]:
                dmag = (g2 * self.pre).sum(axis=0) / self.norm  # (N,)
            gf = g2 * self.factor
        gb = g2 if gf is None else gf  # what reaches the adapter (and, without dropout, W)
        gxa = gb @ b  # (M, r)
        gxa *= np.float32(s)
        db = (gb.T @ xa) * np.float32(s) if self.needs[2] else None  # (N, r)
        da = gxa.T @ xd if self.needs[1] else None  # (r, K)
        dx = None
        if self.needs[0]:
            dx = self._dx(g2, gb, gxa, a, mask)
            dx = dx.reshape(*g.shape[:-1], dx.shape[-1]).astype(self.in_dtype, copy=False)
        dbias = g.reshape(-1, g.shape[-1]).sum(axis=0) if self.needs[4] else None
        return dx, da, db, dmag, dbias

    def _dx(self, g2, gb, gxa, a, mask):
        """dx of W x + (f-1) W x' + f s B A x' (LoRA: f = 1), x' = mask * x / (1 - p)."""
        if mask is None:
            dx = frozen_bwd(gb, self.weight, self.device)  # (M, K)
            kernels.add_product(dx, gxa, a, self.device)
            return dx
        dx = frozen_bwd(g2, self.weight, self.device)
        through = gxa @ a  # (M, K)
        if self.factor is not None:
            through += frozen_bwd(gb - g2, self.weight, self.device)
        dx += through * mask * np.float32(1.0 / (1.0 - self.dropout))
        return dx


def row_norms(weight, a, b, scale, device):
    """||W + s * B @ A|| per output row (N,), from a packed W decoded in bounded row tiles."""
    xp = device.xp
    n, k = weight.shape
    out = xp.empty(n, dtype=np.float32)
    if isinstance(weight, Tensor):
        return xp.linalg.norm(weight.data + scale * (b @ a), axis=1).astype(np.float32)
    rows = max(1, device.scratch_cap // (4 * k))
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        tile = device.scratch((n1 - n0) * k, np.float32).reshape(n1 - n0, k)
        kernels.dequantize_rows(weight, n0, n1, tile)
        tile += scale * (b[n0:n1] @ a)
        out[n0:n1] = xp.sqrt((tile * tile).sum(axis=1))
    return out
