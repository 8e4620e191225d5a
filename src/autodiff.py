"""Tape-based reverse-mode autodiff: Function nodes, the backward walk, and the recording switch."""
import contextlib

from .errors import AutodiffError, DeviceError

_RECORDING = [True]
_REMAKING = [True]  # whether consumers may keep a remaking producer instead of its output
_GRAD_HOOK = [None]  # on_complete_grad
_PLAIN = [None]  # plain_arrays: the device whose ops take and give plain arrays


@contextlib.contextmanager
def without_autodiff():
    """Nothing computed inside the block is recorded on the tape."""
    _RECORDING.append(False)
    try:
        yield
    finally:
        _RECORDING.pop()


@contextlib.contextmanager
def on_complete_grad(hook):
    """Within the block, hook(leaf) runs as soon as backward() has added the last contribution
    to a leaf's gradient (every use of the leaf on the tape has been walked): the trainer
    applies and frees each adapter gradient there (train.step_in_backward)."""
    prev, _GRAD_HOOK[0] = _GRAD_HOOK[0], hook
    try:
        yield
    finally:
        _GRAD_HOOK[0] = prev


def is_recording():
    return _RECORDING[-1]


@contextlib.contextmanager
def plain_arrays(device):
    """Within the block, ops on `device` take and give plain arrays: nothing is recorded, no
    output is wrapped in a Tensor or tracked (Tensor inputs, such as parameters, are unwrapped).
    For decoding's one-token steps, ~600 ops a token whose outputs are a few KiB: the wrapping
    cost more than most of the ops. Module code runs unchanged on arrays (reshape, +, @, [])."""
    _PLAIN.append(device)
    try:
        with without_autodiff():
            yield
    finally:
        _PLAIN.pop()


def plain(x):
    """x's array where x is a Tensor, else x."""
    return x.data if isinstance(x, Recorded) else x


@contextlib.contextmanager
def keeping_outputs():
    """Within the block, ops save outputs rather than remake them (Function.remakes): a
    checkpointed block's recompute, whose saves live for that block's backward only, so a
    remade array would add a fresh allocation to the backward and save nothing lasting (a 7B
    step measured 50 MiB more RSS remaking there)."""
    _REMAKING.append(False)
    try:
        yield
    finally:
        _REMAKING.pop()


def may_remake(node):
    """Whether a consumer may keep `node` (a parent) and remake its output in backward."""
    return _REMAKING[-1] and getattr(node, "remakes", False)


class Recorded:
    """Base of Tensor: lets the tape tell tensors from plain values (and make its outputs of the
    inputs' class) without importing tensor.py, which builds on this module."""

    __slots__ = ()


class Function:
    """One op on the tape. Subclasses write `forward(*arrays)` and `backward(grad)` against xp.

    `self.needs[i]` says whether input i needs a gradient; an op saves an input only when another
    input's gradient needs it (Burn's rule). `backward` returns one gradient (or None) per input.
    Saved state is dropped right after backward runs. A recorded op's `parents` are set before
    its forward runs.

    An op with `remakes = True` can give its output again from what it saved (`remake()`): an op
    that would save that output may keep the producing node instead and remake the array in its
    backward (which runs before the producer's), so the output is freed after the forward.
    """

    remakes = False

    __slots__ = ("device", "xp", "needs", "parents", "saved", "consumed", "__dict__")

    def __init__(self, device, needs):
        self.device = device
        self.xp = device.xp
        self.needs = needs
        self.parents = ()
        self.saved = ()
        self.consumed = False

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no forward")

    def backward(self, grad):
        raise NotImplementedError(f"{type(self).__name__} has no backward")

    def save(self, *arrays):
        """Keep arrays for backward; intermediates are counted by the memory tracker. An op
        that is not recorded has no backward: nothing is kept (or counted) for it."""
        if not any(self.needs):
            return
        mem = self.device.memory
        for a in arrays:
            if a is not None and hasattr(a, "nbytes"):
                mem.track(a)
        self.saved = arrays

    def remake(self):
        """This op's output, computed again from its saved arrays (ops with remakes = True)."""
        raise NotImplementedError(f"{type(self).__name__} cannot remake its output")

    def release(self):
        self.saved = ()
        self.parents = ()
        self.__dict__.clear()

    @classmethod
    def apply(cls, *inputs, **kwargs):
        """Run the op on Tensors (or plain values) and record it when autodiff is on."""
        if _PLAIN[-1] is not None:
            fn = cls(_PLAIN[-1], (False,) * len(inputs))
            return fn.forward(*[plain(t) for t in inputs], **kwargs)
        tensor_cls, device = _common_device(inputs)
        record = device.is_autodiff() and is_recording()
        if record:  # (generation runs ~600 ops a token unrecorded: nothing to ask them there)
            needs = tuple(isinstance(t, Recorded) and t.is_tracked() for t in inputs)
            record = any(needs)
        fn = cls(device, needs if record else (False,) * len(inputs))
        arrays = [plain(t) for t in inputs]
        if record:
            fn.parents = tuple(parent_ref(t) for t in inputs)
        out = fn.forward(*arrays, **kwargs)
        if record:
            return tensor_cls(out, device, _fn=fn)
        return tensor_cls(out, device)


def parent_ref(t):
    """What the tape keeps of an input: the Function that made it, or the trainable leaf itself.
    Never an intermediate Tensor, so its data is freed unless some op saved it."""
    if not isinstance(t, Recorded):
        return None
    if t._fn is not None:
        return t._fn
    return t if t.requires_grad else None


def _common_device(inputs):
    """(type, device) of the first Recorded input; every Recorded input on the same hardware."""
    device = tensor_cls = None
    for t in inputs:
        if isinstance(t, Recorded):
            if device is None:
                device, tensor_cls = t.device, type(t)
            elif not device.same_hardware(t.device):
                raise DeviceError(f"an op mixes tensors on {device} and {t.device}; "
                                  "move them with t.to_device(dev) first")
    if device is None:
        raise AutodiffError("an op needs at least one Tensor input")
    return tensor_cls, device


def _topo_order(root_fn):
    """Functions reachable from root_fn, each after every function that consumes it."""
    order, seen, stack = [], set(), [(root_fn, False)]
    while stack:
        fn, expanded = stack.pop()
        if expanded:
            order.append(fn)
            continue
        if id(fn) in seen:
            continue
        if fn.consumed:
            raise AutodiffError(
                "backward() reached a graph that an earlier backward() already consumed and freed; "
                "recompute the loss, or sum the losses first and call backward() once")
        seen.add(id(fn))
        stack.append((fn, True))
        for p in fn.parents:
            if isinstance(p, Function) and id(p) not in seen:
                stack.append((p, False))
    return order[::-1]


def backward(tensor, grad=None):
    """Walk the tape from `tensor` once, fill `.grad` of leaves that require grad, free the tape."""
    xp = tensor.device.xp
    if grad is None:
        if tensor.size != 1:
            raise AutodiffError(f"backward() needs a scalar loss, got shape {tensor.shape}; "
                                "reduce it first (e.g. loss.sum()) or pass a gradient")
        grad = xp.ones_like(tensor.data)
    elif isinstance(grad, Recorded):
        grad = grad.data
    if tensor._fn is None:
        if tensor.requires_grad:
            _accumulate_leaf(tensor, grad)
            return
        raise AutodiffError("backward() on a tensor that is not tracked: nothing requires grad, "
                            "or it was computed without autodiff (use Device.cpu().autodiff())")
    grads = {id(tensor._fn): grad}
    order = _topo_order(tensor._fn)
    hook = _GRAD_HOOK[0]
    uses = _leaf_uses(order) if hook is not None else None
    for fn in order:
        g = grads.pop(id(fn), None)
        parents, needs = fn.parents, fn.needs
        in_grads = fn.backward(g) if g is not None else (None,) * len(parents)
        fn.consumed = True
        fn.release()
        for p, gi, need in zip(parents, in_grads, needs):
            if not need or gi is None or p is None:
                continue
            if isinstance(p, Function):
                key = id(p)
                grads[key] = grads[key] + gi if key in grads else gi
            else:
                _accumulate_leaf(p, gi)
                if uses is not None:
                    uses[id(p)] -= 1
                    if not uses[id(p)]:
                        hook(p)
        parents = p = gi = None  # drop references before the next node runs


def _leaf_uses(order):
    """{id(leaf): how many gradient contributions it will receive} over the tape `order`."""
    uses = {}
    for fn in order:
        for p, need in zip(fn.parents, fn.needs):
            if need and p is not None and not isinstance(p, Function):
                uses[id(p)] = uses.get(id(p), 0) + 1
    return uses


def _accumulate_leaf(leaf, g):
    xp = leaf.device.xp
    if g.shape != leaf.data.shape:
        g = xp.broadcast_to(g, leaf.data.shape)
    if leaf.grad is None:
        # always a fresh array: an op may hand the same gradient array to several inputs
        g = xp.array(g, dtype=leaf.data.dtype, copy=True)
        leaf.device.memory.track(g, "grads")
        leaf.grad = type(leaf)(g, leaf.device.inner())
    else:
        leaf.grad.data += g
