"""Shape ops: reshape, transpose/permute, indexing, concat, split, sum and mean."""
from .. import kernels
from ..autodiff import Function


class Reshape(Function):
    def forward(self, a, shape):
        self.in_shape = a.shape
        return a.reshape(shape)

    def backward(self, g):
        return (g.reshape(self.in_shape), None)


class Transpose(Function):
    def forward(self, a, axes):
        axes = tuple(range(a.ndim))[::-1] if axes is None else tuple(ax % a.ndim for ax in axes)
        self.inverse = tuple(sorted(range(len(axes)), key=lambda i: axes[i]))
        return a.transpose(axes)

    def backward(self, g):
        return (g.transpose(self.inverse), None)


class GetItem(Function):
    def forward(self, a, index):
        self.in_shape, self.in_dtype, self.index = a.shape, a.dtype, index
        return a[index]

    def backward(self, g):
        xp = self.xp
        out = xp.zeros(self.in_shape, dtype=g.dtype)
        if _is_basic(self.index):
            out[self.index] = g
        else:
            kernels.scatter_add(xp, out, self.index, g)  # advanced indices may repeat
        return (out, None)


def _is_basic(index):
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (int, slice)) or i is None or i is Ellipsis for i in items)


class Concat(Function):
    def forward(self, *arrays, axis=0):
        self.axis = axis
        self.sizes = [a.shape[axis] for a in arrays]
        return self.xp.concatenate(arrays, axis=axis)

    def backward(self, g):
        outs, start = [], 0
        for n, need in zip(self.sizes, self.needs):
            idx = [slice(None)] * g.ndim
            idx[self.axis] = slice(start, start + n)
            outs.append(g[tuple(idx)] if need else None)
            start += n
        return tuple(outs)


class Sum(Function):
    def forward(self, a, axis=None, keepdims=False):
        self.in_shape, self.axis, self.keepdims = a.shape, axis, keepdims
        return a.sum(axis=axis, keepdims=keepdims)

    def backward(self, g):
        return (_expand(self.xp, g, self.in_shape, self.axis, self.keepdims),)


class Mean(Function):
    def forward(self, a, axis=None, keepdims=False):
        self.in_shape, self.axis, self.keepdims = a.shape, axis, keepdims
        out = a.mean(axis=axis, keepdims=keepdims)
        self.count = a.size // max(out.size, 1)
        return out

    def backward(self, g):
        return (_expand(self.xp, g / self.count, self.in_shape, self.axis, self.keepdims),)


def _expand(xp, g, shape, axis, keepdims):
    if axis is not None and not keepdims:
        axes = (axis,) if isinstance(axis, int) else axis
        for ax in sorted(a % len(shape) for a in axes):
            g = xp.expand_dims(g, ax)
    return xp.broadcast_to(g, shape)
