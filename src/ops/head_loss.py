"""LM head + cross-entropy fused over row chunks: full [tokens x vocab] logits never exist."""
import numpy as np

from .. import kernels
from ..autodiff import Function
from ..tensor import Tensor
from .linear import frozen_bwd, frozen_fwd


class HeadCrossEntropy(Function):
    """Mean NLL of targets (N,) given hidden states h (N, D) and the head weight (V, D).

    Only rows with a target reach the head (on chat data most positions are prompt: SmolLM2's
    demo has 9,226 targets in 23,433 tokens), one chunk of logits at a time. When h needs a
    gradient, the forward turns each chunk
    into (softmax - onehot) / count in place right away and multiplies it back into dh (the loss
    is a scalar, so backward only scales dh by the incoming gradient): no logits are recomputed.
    The head is a frozen dense Tensor or a PackedWeight (passed as `head`).
    """

    def forward(self, h, targets, head=None, ignore_index=-100, chunk=256):
        xp, mem = self.xp, self.device.memory
        rows = xp.flatnonzero(targets != ignore_index)  # only target positions meet the head
        count = max(int(rows.size), 1)
        dh = mem.track(xp.zeros_like(h)) if self.needs[0] else None  # (N, D)
        total = 0.0
        with mem.category("logits"):
            for i in range(0, rows.size, chunk):
                at = rows[i:i + chunk]
                z = mem.track(frozen_fwd(h[at], head, self.device))  # (c, V)
                lse, part = kernels.ce_forward(xp, z, targets[at], ignore_index)
                total += part
                if dh is not None:
                    dh[at] = frozen_bwd(kernels.ce_backward_(xp, z, targets[at], ignore_index, lse,
                                                     1.0 / count), head, self.device)
                del z
        self.save(dh)
        return xp.asarray(total / count, dtype=np.float32)

    def backward(self, g):
        (dh,) = self.saved
        return dh * g.astype(dh.dtype), None


def head_cross_entropy(h, head, targets, ignore_index=-100, chunk=256):
    """Fused LM head + mean cross-entropy. h: Tensor (N, D); head: Tensor or PackedWeight (V, D)."""
    t = targets.data if isinstance(targets, Tensor) else h.device.xp.asarray(targets)
    return HeadCrossEntropy.apply(h, t, head=head, ignore_index=ignore_index, chunk=chunk)
