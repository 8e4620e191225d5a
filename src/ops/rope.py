"""Fused rotary position embedding (rotate-half layout, as Hugging Face Llama models use)."""
from ..autodiff import Function


class Rope(Function):
    """x: (B, T, H, D); cos, sin: (T, D/2). Rotates the pairs (x[..., i], x[..., i + D/2])."""

    def forward(self, x, cos, sin):
        half = x.shape[-1] // 2
        c = cos[None, :, None, :].astype(x.dtype, copy=False)  # (1, T, 1, D/2)
        s = sin[None, :, None, :].astype(x.dtype, copy=False)
        self.cs = (c, s)
        x1, x2 = x[..., :half], x[..., half:]
        out = self.xp.empty_like(x)
        out[..., :half] = x1 * c - x2 * s
        out[..., half:] = x2 * c + x1 * s
        return out

    def backward(self, g):
        c, s = self.cs
        half = g.shape[-1] // 2
        g1, g2 = g[..., :half], g[..., half:]
        dx = self.xp.empty_like(g)
        dx[..., :half] = g1 * c + g2 * s
        dx[..., half:] = g2 * c - g1 * s
        return dx, None, None
