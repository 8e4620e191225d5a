"""Fused RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, one tape node."""
from ..autodiff import Function


class RMSNorm(Function):
    def forward(self, x, weight, eps=1e-6):
        xp = self.xp
        ms = (x * x).mean(axis=-1, keepdims=True)  # (..., 1)
        r = 1.0 / xp.sqrt(ms + eps)
        r = r.astype(x.dtype, copy=False)
        self.save(x, r, weight)
        return x * r * weight

    def backward(self, g):
        x, r, w = self.saved
        xhat = x * r
        gw = g * w
        dx = None
        if self.needs[0]:
            dx = r * (gw - xhat * (gw * xhat).mean(axis=-1, keepdims=True))
        dw = None
        if self.needs[1]:
            dw = (g * xhat).reshape(-1, x.shape[-1]).sum(axis=0)
        return dx, dw, None
