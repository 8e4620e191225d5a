"""Fused RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, one tape node."""
import numpy as np

from ..autodiff import Function


class RMSNorm(Function):
    def forward(self, x, weight, eps=1e-6):
        xp = self.xp
        if xp is np:
            from ..kernels.cpu import elementwise as ew
            x2 = ew.rows2(x)
            y = np.empty_like(x2)
            r = np.empty(x2.shape[0], dtype=x.dtype)
            ew.rmsnorm_fwd(x2, weight.astype(x.dtype, copy=False), eps, y, r)
            self.save(x2, r, weight)
            self.shape = x.shape
            return y.reshape(x.shape)
        ms = (x * x).mean(axis=-1, keepdims=True)
        r = (1.0 / xp.sqrt(ms + eps)).astype(x.dtype, copy=False)
        self.save(x, r, weight)
        self.shape = x.shape
        return x * r * weight

    def backward(self, g):
        x, r, w = self.saved
        xp = self.xp
        d = self.shape[-1]
        x2 = x.reshape(-1, d)
        r2 = r.reshape(-1, 1)
        g2 = xp.ascontiguousarray(g).reshape(-1, d)
        dx = dw = None
        if self.needs[0]:
            if xp is np:
                from ..kernels.cpu import elementwise as ew
                dx = np.empty_like(x2)
                ew.rmsnorm_bwd(g2, x2, w.astype(x2.dtype, copy=False), r.reshape(-1), dx)
            else:
                xhat = x2 * r2
                gw = g2 * w
                dx = r2 * (gw - xhat * (gw * xhat).mean(axis=-1, keepdims=True))
            dx = dx.reshape(self.shape)
        if self.needs[1]:
            dw = (g2 * x2 * r2).sum(axis=0)
        return dx, dw, None
