"""Elementwise arithmetic with broadcasting, unary math, and batched matmul."""
from ..autodiff import Function


def unbroadcast(xp, g, shape):
    """Sum a broadcast gradient back down to `shape`."""
    if g.shape == tuple(shape):
        return g
    extra = g.ndim - len(shape)
    if extra:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g


def _shape(a):
    return getattr(a, "shape", ())


class Add(Function):
    def forward(self, a, b):
        self.shapes = (_shape(a), _shape(b))
        return a + b

    def backward(self, g):
        sa, sb = self.shapes
        return (unbroadcast(self.xp, g, sa) if self.needs[0] else None,
                unbroadcast(self.xp, g, sb) if self.needs[1] else None)


class Sub(Function):
    def forward(self, a, b):
        self.shapes = (_shape(a), _shape(b))
        return a - b

    def backward(self, g):
        sa, sb = self.shapes
        return (unbroadcast(self.xp, g, sa) if self.needs[0] else None,
                unbroadcast(self.xp, -g, sb) if self.needs[1] else None)


class Mul(Function):
    def forward(self, a, b):
        # save an input only when the other input's gradient needs it
        self.save(b if self.needs[0] else None, a if self.needs[1] else None)
        self.shapes = (_shape(a), _shape(b))
        return a * b

    def backward(self, g):
        b, a = self.saved
        sa, sb = self.shapes
        return (unbroadcast(self.xp, g * b, sa) if self.needs[0] else None,
                unbroadcast(self.xp, g * a, sb) if self.needs[1] else None)


class Div(Function):
    def forward(self, a, b):
        out = a / b
        self.save(b, out if self.needs[1] else None)
        self.shapes = (_shape(a), _shape(b))
        return out

    def backward(self, g):
        b, out = self.saved
        sa, sb = self.shapes
        ga = g / b
        return (unbroadcast(self.xp, ga, sa) if self.needs[0] else None,
                unbroadcast(self.xp, -ga * out, sb) if self.needs[1] else None)


class Neg(Function):
    def forward(self, a):
        return -a

    def backward(self, g):
        return (-g,)


class Pow(Function):
    """a ** p for a constant exponent p."""

    def forward(self, a, p):
        self.p = p
        self.save(a)
        return a ** p

    def backward(self, g):
        (a,) = self.saved
        return (g * self.p * a ** (self.p - 1), None)


class Exp(Function):
    def forward(self, a):
        out = self.xp.exp(a)
        self.save(out)
        return out

    def backward(self, g):
        return (g * self.saved[0],)


class Log(Function):
    def forward(self, a):
        self.save(a)
        return self.xp.log(a)

    def backward(self, g):
        return (g / self.saved[0],)


class Sqrt(Function):
    def forward(self, a):
        out = self.xp.sqrt(a)
        self.save(out)
        return out

    def backward(self, g):
        return (g / (2 * self.saved[0]),)


class MatMul(Function):
    """a @ b with numpy's batched broadcasting rules (both at least 2-D)."""

    def forward(self, a, b):
        self.save(b if self.needs[0] else None, a if self.needs[1] else None)
        self.shapes = (a.shape, b.shape)
        return a @ b

    def backward(self, g):
        b, a = self.saved
        sa, sb = self.shapes
        xp = self.xp
        ga = unbroadcast(xp, g @ xp.swapaxes(b, -1, -2), sa) if self.needs[0] else None
        gb = unbroadcast(xp, xp.swapaxes(a, -1, -2) @ g, sb) if self.needs[1] else None
        return ga, gb
