"""AdamW with decoupled weight decay (moments in float32 or 8 bits, see states.py) for trainable
tensors only, and clipping."""
import math

import numpy as np

from ..kernels import adamw8_update
from .states import BlockState8bit, make_state


class AdamW:
    """AdamW over (name, Tensor) pairs. States live in the `optimizer` memory category;
    state_bits 8 keeps them as bitsandbytes' 8-bit blockwise optimizers do."""

    def __init__(self, named_params, lr=2e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 state_bits=32):
        self.params = list(named_params)
        if not self.params:
            raise ValueError("AdamW got no trainable parameters")
        self.lr, self.eps, self.weight_decay = float(lr), float(eps), float(weight_decay)
        self.b1, self.b2 = (float(b) for b in betas)
        self.t = 0
        dev = self.params[0][1].device
        self.xp = xp = dev.xp
        mem = dev.memory
        with mem.category("optimizer"):
            self.m = {n: make_state(p.shape, state_bits, mem, xp, True) for n, p in self.params}
            self.v = {n: make_state(p.shape, state_bits, mem, xp, False) for n, p in self.params}

    def step(self, lr=None):
        """One update from each parameter's .grad (parameters without a grad are skipped)."""
        self.begin_step(lr)
        for name, p in self.params:
            if p.grad is not None:
                self.update(name, p)

    def begin_step(self, lr=None):
        """Start step t + 1 at learning rate lr; update() then applies each parameter's grad
        (step() does both; the trainer's step_in_backward calls update() as grads complete)."""
        self._lr = self.lr if lr is None else float(lr)
        self.t += 1

    def update(self, name, p):
        """Apply p.grad to parameter `name` (p) for the step begin_step started."""
        lr = self._lr
        c1 = 1.0 - self.b1 ** self.t
        c2 = 1.0 - self.b2 ** self.t
        if self._fused_8bit(name, p, lr, c1, c2):
            return
        g, m, v, w = p.grad.data, self.m[name].load(), self.v[name].load(), p.data
        if self.weight_decay:
            w *= 1.0 - lr * self.weight_decay
        m *= self.b1
        m += (1.0 - self.b1) * g
        v *= self.b2
        v += (1.0 - self.b2) * (g * g)
        self.m[name].store(m)
        self.v[name].store(v)
        denom = self.xp.sqrt(v / c2)
        denom += self.eps
        w -= (lr / c1) * (m / denom)

    def _fused_8bit(self, name, p, lr, c1, c2):
        """The same step by one fused kernel where both moments are 8-bit and a kernel takes
        the arrays (same float32 arithmetic, in one pass per block); False otherwise."""
        m, v = self.m[name], self.v[name]
        if not isinstance(m, BlockState8bit):
            return False
        hyper = {"decay": 1.0 - lr * self.weight_decay if self.weight_decay else 1.0,
                 "b1": self.b1, "one_b1": 1.0 - self.b1, "b2": self.b2, "one_b2": 1.0 - self.b2,
                 "c2": c2, "eps": self.eps, "step_size": lr / c1}
        return adamw8_update(p.data, p.grad.data, m.parts(), v.parts(), hyper)

    def zero_grad(self):
        for _, p in self.params:
            p.grad = None

    def state_arrays(self):
        out = {}
        for n, _ in self.params:
            out.update(self.m[n].arrays(f"{n}.exp_avg"))
            out.update(self.v[n].arrays(f"{n}.exp_avg_sq"))
        return out

    def load_state_arrays(self, arrays, step):
        for n, _ in self.params:
            self.m[n].restore(arrays, f"{n}.exp_avg", self.xp)
            self.v[n].restore(arrays, f"{n}.exp_avg_sq", self.xp)
        self.t = int(step)


def clip_grad_norm(params, max_norm):
    """Scale grads so their global L2 norm is at most max_norm; returns the norm before."""
    grads = [p.grad.data for _, p in params if p.grad is not None]
    # summed where the gradients live: on a GPU one copy to the host, not one per tensor
    total = float(sum((g * g).sum(dtype=np.float64) for g in grads)) if grads else 0.0
    norm = math.sqrt(total)
    if max_norm is not None and norm > max_norm and norm > 0:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g *= scale
    return norm
