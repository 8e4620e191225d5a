"""Fused rotary position embedding (rotate-half layout, as Hugging Face Llama models use)."""
import numpy as np

from ..autodiff import Function


def _rotate(xp, x, c, s, sign):
    half = x.shape[-1] // 2
    if xp is np:
        from ..kernels.cpu import elementwise as ew
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        ew.rope_apply(x, c, s, out, sign)
        return out
    cb, sb = c[None, :, None, :], sign * s[None, :, None, :]  # (1, T, 1, D/2)
    x1, x2 = x[..., :half], x[..., half:]
    out = xp.empty_like(x)
    out[..., :half] = x1 * cb - x2 * sb
    out[..., half:] = x2 * cb + x1 * sb
    return out


class Rope(Function):
    """x: (B, T, H, D); cos, sin: (T, D/2). Rotates the pairs (x[..., i], x[..., i + D/2])."""

    def forward(self, x, cos, sin):
        c = cos.astype(x.dtype, copy=False)
        s = sin.astype(x.dtype, copy=False)
        self.cs = (c, s)
        return _rotate(self.xp, x, c, s, 1.0)

    def backward(self, g):
        c, s = self.cs
        return _rotate(self.xp, g, c, s, -1.0), None, None
