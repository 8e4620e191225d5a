"""Tensor: an xp array on a Device, with optional gradient recording."""
import numpy as np

from . import autodiff
from .device import Device
from .errors import AutodiffError


class Tensor(autodiff.Recorded):
    """Wraps a numpy/cupy array and its device. Leaves may `require_grad()`; ops record a tape."""

    __slots__ = ("data", "device", "requires_grad", "grad", "_fn", "__weakref__")
    __array_priority__ = 1000  # so `ndarray + Tensor` calls Tensor.__radd__

    def __init__(self, data, device=None, dtype=None, _fn=None):
        device = device if device is not None else Device.cpu()
        xp = device.xp
        if not isinstance(data, xp.ndarray) or (dtype is not None and data.dtype != dtype):
            if dtype is None and not hasattr(data, "dtype"):
                arr = np.asarray(data)
                dtype = np.float32 if arr.dtype.kind == "f" else arr.dtype
            data = xp.asarray(data, dtype=dtype)
        self.data = data
        self.device = device
        self.requires_grad = False
        self.grad = None
        self._fn = _fn
        device.memory.track(data)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_numpy(cls, array, device=None, dtype=None):
        return cls(array if device is None else device.xp.asarray(array), device, dtype)

    def numpy(self):
        """A numpy array with this tensor's values (copied to host on a GPU)."""
        data = self.data
        return data.get() if hasattr(data, "get") else np.asarray(data)

    def item(self):
        return self.numpy().item()

    # -- autodiff state -----------------------------------------------------------------------
    def require_grad(self):
        """Mark a leaf as trainable: backward() fills its .grad."""
        if self._fn is not None:
            raise AutodiffError("require_grad() is only allowed on leaf tensors, not on the "
                                "result of an op; use detach() first to make a new leaf")
        self.requires_grad = True
        return self

    def is_require_grad(self):
        return self.requires_grad

    def is_tracked(self):
        """True when ops on this tensor are recorded (a trainable leaf or a recorded result)."""
        return self.device.is_autodiff() and (self.requires_grad or self._fn is not None)

    def detach(self):
        """The same data as a new leaf, cut out of the tape."""
        return Tensor(self.data, self.device)

    def backward(self, grad=None):
        autodiff.backward(self, grad)

    def zero_grad(self):
        self.grad = None

    def to_device(self, device):
        """Move the data to `device`; autodiff and require-grad state go with it."""
        if device.same_hardware(self.device):
            data = self.data
        elif device.kind == "cpu":
            data = self.numpy()
        else:
            data = device.xp.asarray(self.data)
        out = Tensor(data, device if self.device.is_autodiff() == device.is_autodiff()
                     else (device.autodiff() if self.device.is_autodiff() else device.inner()))
        out.requires_grad = self.requires_grad
        return out

    # -- properties ---------------------------------------------------------------------------
    @property
    def shape(self):
        return tuple(self.data.shape)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self):
        return self.data.ndim

    @property
    def size(self):
        return int(self.data.size)

    @property
    def nbytes(self):
        return int(self.data.nbytes)

    def __len__(self):
        return self.data.shape[0]

    def __repr__(self):
        flag = ", requires_grad" if self.requires_grad else (", tracked" if self._fn else "")
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, device={self.device}{flag})"

    # -- operators (defined in ops; attached in ops/__init__) -----------------------------------


def zeros(shape, device=None, dtype=np.float32):
    device = device or Device.cpu()
    return Tensor(device.xp.zeros(shape, dtype=dtype), device)


def ones(shape, device=None, dtype=np.float32):
    device = device or Device.cpu()
    return Tensor(device.xp.ones(shape, dtype=dtype), device)


def full(shape, value, device=None, dtype=np.float32):
    device = device or Device.cpu()
    return Tensor(device.xp.full(shape, value, dtype=dtype), device)


def randn(shape, device=None, dtype=np.float32, std=1.0):
    """Normal samples from the device's generator (seeded with dev.seed(n))."""
    device = device or Device.cpu()
    gen_dtype = np.float64 if dtype == np.float64 else np.float32
    data = device.rng.standard_normal(shape, dtype=gen_dtype)
    return Tensor(data * std if std != 1.0 else data, device, dtype=dtype)


def uniform(shape, low, high, device=None, dtype=np.float32):
    device = device or Device.cpu()
    data = device.rng.uniform(low, high, size=shape)
    return Tensor(data.astype(dtype), device)
