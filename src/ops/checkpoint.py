"""Gradient checkpointing: run a block without keeping its activations, recompute in backward."""
from .. import autodiff
from ..autodiff import Function
from ..tensor import Tensor


class Checkpoint(Function):
    """out = block(x), recording nothing; backward re-runs block(x) with recording and
    backpropagates through it. Trainable leaves inside the block get their grads directly.
    The device RNG state is replayed so dropout masks match between the two runs."""

    def forward(self, x, block=None, args=(), recompute=None):
        self.block, self.args = block, args
        self.recompute = recompute or block
        self.rng_state = self.device.rng_state()
        self.x = x
        with autodiff.without_autodiff():
            out = block(Tensor(x, self.device), *args)
        return out.data

    def backward(self, g):
        now = self.device.rng_state()
        self.device.set_rng_state(self.rng_state)
        x = Tensor(self.x, self.device)
        if self.needs[0]:
            x.require_grad()
        with autodiff.keeping_outputs():
            out = self.recompute(x, *self.args)
        self.device.set_rng_state(now)
        if out._fn is None:  # nothing inside the block is trainable
            return (None,)
        autodiff.backward(out, g)
        return (x.grad.data if x.grad is not None else None,)


def checkpoint(block, x, *args, recompute=None):
    """`block(x, *args)` under gradient checkpointing. Recorded even when x itself is not tracked,
    since the block's trainable parameters (e.g. LoRA adapters) need their gradients. recompute:
    what backward re-runs instead of block (same arguments, the same ops recorded), e.g. one
    that skips computing the output's value, which backward never reads."""
    dev = x.device
    if not (dev.is_autodiff() and autodiff.is_recording()):
        return block(x, *args)
    fn = Checkpoint(dev, (x.is_tracked(),))
    out = fn.forward(x.data, block=block, args=args, recompute=recompute)
    fn.parents = (autodiff.parent_ref(x),)
    return Tensor(out, dev, _fn=fn)
