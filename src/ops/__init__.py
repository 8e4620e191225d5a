"""Functional ops on Tensors; each is one Function node with a paired backward."""
import numpy as np

from ..tensor import Tensor
from .activations import Dropout, Embedding, Silu, Softmax, SwiGLU
from .arith import Add, Div, Exp, Log, MatMul, Mul, Neg, Pow, Sqrt, Sub
from .attention import Attention
from .checkpoint import checkpoint
from .head_loss import head_cross_entropy
from .loss import CrossEntropy
from .norm import RMSNorm
from .rope import Rope
from .shape import Concat, GetItem, Mean, Reshape, Sum, Transpose

__all__ = ["add", "sub", "mul", "div", "neg", "pow", "matmul", "exp", "log", "sqrt", "sum",
           "mean", "reshape", "transpose", "permute", "concat", "split", "silu", "swiglu",
           "softmax", "rms_norm", "rope", "attention", "cross_entropy", "embedding", "dropout",
           "checkpoint", "head_cross_entropy"]


def _scalar(a, like):
    """Python scalars become 0-d arrays of the tensor's dtype (so float32 stays float32)."""
    if isinstance(a, Tensor):
        return a
    return like.device.xp.asarray(a, dtype=like.dtype)


def add(a, b):
    return Add.apply(a, b) if isinstance(a, Tensor) else Add.apply(_scalar(a, b), b)


def sub(a, b):
    return Sub.apply(a, b) if isinstance(a, Tensor) else Sub.apply(_scalar(a, b), b)


def mul(a, b):
    return Mul.apply(a, b) if isinstance(a, Tensor) else Mul.apply(_scalar(a, b), b)


def div(a, b):
    return Div.apply(a, b) if isinstance(a, Tensor) else Div.apply(_scalar(a, b), b)


def neg(a):
    return Neg.apply(a)


def pow(a, p):  # noqa: A001  (mirrors the operator's name)
    if isinstance(p, Tensor):
        return exp(mul(p, log(a)))
    return Pow.apply(a, p)


def matmul(a, b):
    return MatMul.apply(a, b)


def exp(a):
    return Exp.apply(a)


def log(a):
    return Log.apply(a)


def sqrt(a):
    return Sqrt.apply(a)


def sum(a, axis=None, keepdims=False):  # noqa: A001
    return Sum.apply(a, axis=axis, keepdims=keepdims)


def mean(a, axis=None, keepdims=False):
    return Mean.apply(a, axis=axis, keepdims=keepdims)


def reshape(a, *shape):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return Reshape.apply(a, tuple(shape))


def transpose(a, *axes):
    axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
    return Transpose.apply(a, tuple(axes) if axes else None)


permute = transpose


def getitem(a, index):
    if isinstance(index, Tensor):
        index = index.data
    elif isinstance(index, tuple):
        index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return GetItem.apply(a, index)


def concat(tensors, axis=0):
    return Concat.apply(*tensors, axis=axis)


def split(a, sizes, axis=-1):
    """Split along `axis` into pieces of the given sizes (or `sizes` equal pieces if an int)."""
    axis = axis % a.ndim
    n = a.shape[axis]
    if isinstance(sizes, int):
        sizes = [n // sizes] * sizes
    out, start = [], 0
    for size in sizes:
        idx = [slice(None)] * a.ndim
        idx[axis] = slice(start, start + size)
        out.append(getitem(a, tuple(idx)))
        start += size
    return out


def silu(x):
    return Silu.apply(x)


def swiglu(gate, up):
    """silu(gate) * up, fused."""
    return SwiGLU.apply(gate, up)


def softmax(x, axis=-1):
    return Softmax.apply(x, axis=axis)


def rms_norm(x, weight, eps=1e-6):
    return RMSNorm.apply(x, weight, eps=eps)


def rope(x, cos, sin):
    """Rotary embedding of x (B, T, H, D) with cos/sin tables (T, D/2) (arrays or Tensors)."""
    cos = cos.data if isinstance(cos, Tensor) else cos
    sin = sin.data if isinstance(sin, Tensor) else sin
    return Rope.apply(x, cos, sin)


def attention(q, k, v, scale=None, key_valid=None, segments=None):
    """Causal attention; q (B, T, H, D), k/v (B, S, Hkv, D) with H a multiple of Hkv.
    key_valid (B, S) bool, optional, masks padding keys (left-padded batches); segments (B, S)
    int, optional, numbers the examples packed in each row (block-diagonal attention)."""
    return Attention.apply(q, k, v, scale=scale, key_valid=key_valid, segments=segments)


def cross_entropy(logits, targets, ignore_index=-100, chunk=256):
    """Mean cross-entropy of logits (..., V) against integer targets, skipping ignore_index."""
    t = targets.data if isinstance(targets, Tensor) else logits.device.xp.asarray(targets)
    return CrossEntropy.apply(logits, t, ignore_index=ignore_index, chunk=chunk)


def embedding(weight, ids):
    """Rows of `weight` (V, D) for integer ids (...) -> (..., D)."""
    idx = ids.data if isinstance(ids, Tensor) else weight.device.xp.asarray(ids)
    return Embedding.apply(weight, idx)


def dropout(x, p=0.0, training=True):
    if not training or p <= 0.0:
        return x
    if p >= 1.0:
        raise ValueError(f"dropout probability must be < 1, got {p}")
    return Dropout.apply(x, float(p))


def _attach():
    T = Tensor
    T.__add__ = lambda a, b: add(a, b)
    T.__radd__ = lambda a, b: add(b, a)
    T.__sub__ = lambda a, b: sub(a, b)
    T.__rsub__ = lambda a, b: sub(b, a)
    T.__mul__ = lambda a, b: mul(a, b)
    T.__rmul__ = lambda a, b: mul(b, a)
    T.__truediv__ = lambda a, b: div(a, b)
    T.__rtruediv__ = lambda a, b: div(b, a)
    T.__neg__ = lambda a: neg(a)
    T.__pow__ = lambda a, p: pow(a, p)
    T.__matmul__ = lambda a, b: matmul(a, b)
    T.__getitem__ = lambda a, i: getitem(a, i)
    T.sum = lambda a, axis=None, keepdims=False: sum(a, axis, keepdims)
    T.mean = lambda a, axis=None, keepdims=False: mean(a, axis, keepdims)
    T.reshape = lambda a, *s: reshape(a, *s)
    T.transpose = lambda a, *axes: transpose(a, *axes)
    T.permute = T.transpose
    T.exp = lambda a: exp(a)
    T.log = lambda a: log(a)
    T.sqrt = lambda a: sqrt(a)
    T.T = property(lambda a: transpose(a))


_attach()
np.seterr(over="ignore", under="ignore")  # exp(-inf) and friends inside masked softmax
