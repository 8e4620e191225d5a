"""Activations: silu, fused silu(gate)*up (SwiGLU), softmax, dropout, embedding gather."""
import numpy as np

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
    """silu(gate) * up in one node: the MLP's elementwise core."""

    def forward(self, gate, up):
        self.save(gate, up)
        if self.xp is np and gate.shape == up.shape and gate.dtype == up.dtype:
            from ..kernels.cpu import elementwise as ew
            y = np.empty(gate.shape, dtype=gate.dtype)
            ew.swiglu_fwd(ew.rows2(gate), ew.rows2(up), y.reshape(-1, gate.shape[-1]))
            return y
        return gate * _sigmoid(self.xp, gate) * up

    def backward(self, g):
        gate, up = self.saved
        if self.xp is np and gate.shape == up.shape:
            from ..kernels.cpu import elementwise as ew
            d = gate.shape[-1]
            dgate, dup = np.empty_like(gate), np.empty_like(up)
            ew.swiglu_bwd(ew.rows2(g), ew.rows2(gate), ew.rows2(up), dgate.reshape(-1, d),
                          dup.reshape(-1, d), self.needs[0], self.needs[1])
            return (dgate if self.needs[0] else None), (dup if self.needs[1] else None)
        s = _sigmoid(self.xp, gate)
        act = gate * s
        dgate = g * up * (s * (1 + gate * (1 - s))) if self.needs[0] else None
        dup = g * act if self.needs[1] else None
        return dgate, dup


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
        xp.add.at(out, self.ids.reshape(-1), g.reshape(-1, self.wshape[1]))
        return (out, None)
