"""Activations: silu, fused silu(gate)*up (SwiGLU), softmax, dropout, embedding gather."""
import numpy as np

from .. import kernels
from ..autodiff import Function


def _sigmoid(xp, x):
    return 1.0 / (1.0 + xp.exp(-x))


class Silu(Function):
    def forward(self, x):
        self.save(x)
        return x * _sigmoid(self.xp, x)

    def backward(self, g):
        (x,) = self.saved
        s = _sigmoid(self.xp, x)
        return (g * s * (1 + x * (1 - s)),)


class SwiGLU(Function):
    """silu(gate) * up in one node: the MLP's elementwise core. Its output is cheap to remake
    from the saved gate and up, so the down projection's LoRA need not keep it."""

    remakes = True

    def forward(self, gate, up):
        self.save(gate, up)
        return kernels.swiglu_fwd(self.xp, gate, up)

    def remake(self):
        gate, up = self.saved
        return kernels.swiglu_fwd(self.xp, gate, up)

    def backward(self, g):
        gate, up = self.saved
        return kernels.swiglu_bwd(self.xp, g, gate, up, self.needs[0], self.needs[1])


class Softmax(Function):
    def forward(self, x, axis=-1):
        self.axis = axis
        z = x - x.max(axis=axis, keepdims=True)
        e = self.xp.exp(z)
        out = e / e.sum(axis=axis, keepdims=True)
        self.save(out)
        return out

    def backward(self, g):
        (out,) = self.saved
        return (out * (g - (g * out).sum(axis=self.axis, keepdims=True)),)


class Dropout(Function):
    """Zero each element with probability p (mask from the device generator), scale by 1/(1-p)."""

    def forward(self, x, p):
        keep = self.device.rng.random(x.shape, dtype=np.float32) >= p
        scale = x.dtype.type(1.0 / (1.0 - p))
        self.save(keep)
        self.scale = scale
        return x * keep * scale

    def backward(self, g):
        (keep,) = self.saved
        return (g * keep * self.scale, None)


class Embedding(Function):
    """weight[ids]: gather rows; the gradient scatter-adds into the rows that were used."""

    def forward(self, weight, ids):
        self.ids = ids
        self.wshape = weight.shape
        return weight[ids]

    def backward(self, g):
        xp = self.xp
        out = xp.zeros(self.wshape, dtype=g.dtype)
        kernels.scatter_add(xp, out, self.ids, g)  # ids (...), g (..., D)
        return (out, None)
