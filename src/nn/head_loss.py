"""LM head + cross-entropy fused over row chunks: full [tokens x vocab] logits never exist."""
import numpy as np

from .. import kernels
from ..autodiff import Function
from ..tensor import Tensor


def _logits(xp, h, head, device):
    """(rows, V) float32 logits of h (rows, D) against a dense Tensor or a PackedWeight head."""
    if isinstance(head, Tensor):
        return h @ head.data.T
    return kernels.linear_fwd(xp.ascontiguousarray(h, dtype=np.float32), head, device=device)


class HeadCrossEntropy(Function):
    """Mean NLL of targets (N,) given hidden states h (N, D) and the head weight (V, D).

    Forward keeps one chunk of logits at a time; backward recomputes each chunk's logits,
    turns it into (softmax - onehot) in place and multiplies it back, chunk by chunk.
    The head is a frozen dense Tensor or a PackedWeight (passed as `head`).
    """

    def forward(self, h, targets, head=None, ignore_index=-100, chunk=256):
        xp, mem = self.xp, self.device.memory
        valid = targets != ignore_index
        self.count = max(int(valid.sum()), 1)
        total = 0.0
        with mem.category("logits"):
            for i in range(0, h.shape[0], chunk):
                z = mem.track(_logits(xp, h[i:i + chunk], head, self.device))  # (c, V)
                m = z.max(axis=1)
                lse = m + xp.log(xp.exp(z - m[:, None]).sum(axis=1))
                t = targets[i:i + chunk]
                ok = valid[i:i + chunk]
                picked = z[xp.arange(z.shape[0]), xp.where(ok, t, 0)]
                total += float(((lse - picked) * ok).sum())
                del z
        self.head, self.chunk, self.ignore = head, chunk, ignore_index
        self.save(h, targets)
        return xp.asarray(total / self.count, dtype=np.float32)

    def backward(self, g):
        h, targets = self.saved
        xp, mem = self.xp, self.device.memory
        dh = xp.empty_like(h)
        scale = float(g) / self.count
        with mem.category("logits"):
            for i in range(0, h.shape[0], self.chunk):
                z = mem.track(_logits(xp, h[i:i + self.chunk], self.head, self.device))
                z -= z.max(axis=1, keepdims=True)
                xp.exp(z, out=z)
                z /= z.sum(axis=1, keepdims=True)
                t = targets[i:i + self.chunk]
                ok = t != self.ignore
                rows = xp.arange(z.shape[0])
                z[rows, xp.where(ok, t, 0)] -= 1.0
                z *= (ok * scale).astype(z.dtype)[:, None]
                dh[i:i + self.chunk] = self._back(z)
                del z
        return dh, None

    def _back(self, dz):
        if isinstance(self.head, Tensor):
            return dz @ self.head.data
        return kernels.linear_bwd(dz, self.head, device=self.device)


def head_cross_entropy(h, head, targets, ignore_index=-100, chunk=256):
    """Fused LM head + mean cross-entropy. h: Tensor (N, D); head: Tensor or PackedWeight (V, D)."""
    t = targets.data if isinstance(targets, Tensor) else h.device.xp.asarray(targets)
    return HeadCrossEntropy.apply(h, t, head=head, ignore_index=ignore_index, chunk=chunk)
