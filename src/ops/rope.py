"""Fused rotary position embedding (rotate-half layout, as Hugging Face Llama models use)."""
from .. import kernels
from ..autodiff import Function


class Rope(Function):
    """x: (B, T, H, D); cos, sin: (T, D/2), or (B, T, D/2) for positions of each row's own.
    Rotates the pairs (x[..., i], x[..., i + D/2])."""

    def forward(self, x, cos, sin):
        c = cos.astype(x.dtype, copy=False)
        s = sin.astype(x.dtype, copy=False)
        self.cs = (c, s)
        return kernels.rope_rotate(self.xp, x, c, s, 1.0)

    def backward(self, g):
        c, s = self.cs
        return kernels.rope_rotate(self.xp, g, c, s, -1.0), None, None
