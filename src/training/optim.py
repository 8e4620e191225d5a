"""AdamW with decoupled weight decay, float32 states for trainable tensors only, and clipping."""
import math

import numpy as np


class AdamW:
    """AdamW over (name, Tensor) pairs. States live in the `optimizer` memory category."""

    def __init__(self, named_params, lr=2e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        self.params = list(named_params)
        if not self.params:
            raise ValueError("AdamW got no trainable parameters")
        self.lr, self.eps, self.weight_decay = float(lr), float(eps), float(weight_decay)
        self.b1, self.b2 = (float(b) for b in betas)
        self.t = 0
        dev = self.params[0][1].device
        self.xp = xp = dev.xp
        with dev.memory.category("optimizer"):
            self.m = {n: dev.memory.track(xp.zeros(p.shape, np.float32)) for n, p in self.params}
            self.v = {n: dev.memory.track(xp.zeros(p.shape, np.float32)) for n, p in self.params}

    def step(self, lr=None):
        """One update from each parameter's .grad (parameters without a grad are skipped)."""
        lr = self.lr if lr is None else float(lr)
        self.t += 1
        c1 = 1.0 - self.b1 ** self.t
        c2 = 1.0 - self.b2 ** self.t
        step_size = lr / c1
        for name, p in self.params:
            if p.grad is None:
                continue
            g, m, v, w = p.grad.data, self.m[name], self.v[name], p.data
            if self.weight_decay:
                w *= 1.0 - lr * self.weight_decay
            m *= self.b1
            m += (1.0 - self.b1) * g
            v *= self.b2
            v += (1.0 - self.b2) * (g * g)
            denom = self.xp.sqrt(v / c2)
            denom += self.eps
            w -= step_size * (m / denom)

    def zero_grad(self):
        for _, p in self.params:
            p.grad = None

    def state_arrays(self):
        out = {}
        for n, _ in self.params:
            out[f"{n}.exp_avg"] = self.m[n]
            out[f"{n}.exp_avg_sq"] = self.v[n]
        return out

    def load_state_arrays(self, arrays, step):
        for n, _ in self.params:
            for key, store in ((f"{n}.exp_avg", self.m), (f"{n}.exp_avg_sq", self.v)):
                if key not in arrays:
                    raise KeyError(f"optimizer state has no {key!r}")
                store[n][...] = self.xp.asarray(arrays[key])
        self.t = int(step)


def clip_grad_norm(params, max_norm):
    """Scale grads so their global L2 norm is at most max_norm; returns the norm before."""
    total = 0.0
    grads = [p.grad.data for _, p in params if p.grad is not None]
    for g in grads:
        total += float((g * g).sum(dtype=np.float64))
    norm = math.sqrt(total)
    if max_norm is not None and norm > max_norm and norm > 0:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g *= scale
    return norm
