"""Device: picks the array backend (numpy or cupy) and owns RNG, memory tracker and scratch."""
import hashlib
import json
import warnings

import numpy as np

from . import _env  # noqa: F401  (thread-pool settings before numpy/numba load)
from .errors import DeviceError
from .rng import CountingRng, is_counting_state
from .tracker import MemoryTracker

_STATES = {}
# MiB of dense scratch the packed kernels may hold by default (a run config's `scratch_mib`
# overrides it). CPU: larger tiles make the backward's BLAS calls less thin, 8 MiB is
# ~1.1-1.3x dense on 7B shapes. GPU: a tile must give cuBLAS enough work to fill the chip.
DEFAULT_SCRATCH_MIB = {"cpu": 8, "cuda": 64}
DEFAULT_SCRATCH_CAP = DEFAULT_SCRATCH_MIB["cpu"] << 20


class _State:
    """What one physical device owns, shared by its autodiff and plain views."""

    def __init__(self, kind, xp, index):
        self.xp = xp
        gpu = kind != "cpu"
        self.memory = MemoryTracker(kind, xp.get_default_memory_pool() if gpu else None,
                                    xp.cuda.MemoryHook if gpu else None, index)
        self.rng = _make_rng(kind, xp, None)
        self.seed_value = None
        self.scratch_cap = DEFAULT_SCRATCH_MIB[kind] << 20
        self.scratch = None


def _load_cupy(index):
    try:
        import cupy
    except ImportError as exc:
        raise DeviceError(
            "CUDA device requested but cupy is not installed. Install the CUDA extra: "
            "pip install 'packlora[cuda]' (CUDA 12: cupy-cuda12x, numba-cuda[cu12]) or "
            "'packlora[cuda13]' (CUDA 13: cupy-cuda13x, numba-cuda[cu13])"
        ) from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy raises CUDARuntimeError or driver load errors
        raise DeviceError(
            f"CUDA device requested but no usable NVIDIA driver/GPU was found ({exc}). "
            "Use device: cpu, or install the NVIDIA driver and pip install 'packlora[cuda]' "
            "(or 'packlora[cuda13]')"
        ) from None
    if index >= count:
        raise DeviceError(f"cuda:{index} requested but this machine has {count} CUDA device(s)")
    return cupy


def parse_spec(spec):
    """(kind, index, autodiff) of a device spec: 'cpu', 'cuda', 'cuda:1', each with an optional
    '+autodiff'; nothing is opened."""
    text = str(spec).strip().lower()
    autodiff = text.endswith("+autodiff")
    text = text.removesuffix("+autodiff")
    if text == "cpu":
        return "cpu", 0, autodiff
    if text == "cuda" or text.startswith("cuda:"):
        idx = text.partition(":")[2] or "0"
        if not idx.isdigit():
            raise DeviceError(f"bad device {spec!r}: the CUDA index must be a number")
        return "cuda", int(idx), autodiff
    raise DeviceError(f"bad device {spec!r}; use 'cpu', 'cuda' or 'cuda:N'")


def _state(kind, index):
    key = (kind, index)
    if key not in _STATES:
        xp = np if kind == "cpu" else _load_cupy(index)
        _STATES[key] = _State(kind, xp, index)
    return _STATES[key]


def tf32_enabled(cupy):
    """Whether cupy's float32 products may use TF32 tensor cores (inputs rounded to a 10-bit
    mantissa, sums in float32): cupy's own process-wide switch, which CUPY_TF32=1 turns on at
    start and its matmuls follow. packlora's decoded-tile products follow it too (tiled.py)."""
    tf32 = cupy._core._routines_linalg.COMPUTE_TYPE_TF32
    return cupy._core.get_compute_type(np.float32) == tf32


def _make_rng(kind, xp, seed):
    """numpy's Generator on the CPU (its state saves as JSON); on a GPU a generator whose state
    is (seed, draws), since cupy's generators cannot save theirs."""
    return xp.random.default_rng(seed) if kind == "cpu" else CountingRng(xp, seed)


class Device:
    """A compute device. `Device.cpu()`, `Device.cuda(0)`, `Device.parse("cuda:1")`.

    `dev.autodiff()` is the same device with gradient recording on; `dev.inner()` with it off.
    """

    def __init__(self, kind="cpu", index=0, autodiff=False):
        if kind not in ("cpu", "cuda"):
            raise DeviceError(f"unknown device kind {kind!r}; use 'cpu' or 'cuda[:N]'")
        self.kind = kind
        self.index = int(index)
        self._autodiff = bool(autodiff)
        self._state = _state(kind, self.index)
        if kind == "cuda":  # allocations and launches of this device go to GPU `index`
            self._state.xp.cuda.Device(self.index).use()

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def cpu(cls):
        return cls("cpu", 0)

    @classmethod
    def cuda(cls, index=0):
        return cls("cuda", index)

    @classmethod
    def parse(cls, spec):
        """'cpu', 'cuda', 'cuda:1'; a '+autodiff' suffix turns recording on."""
        if isinstance(spec, Device):
            return spec
        return cls(*parse_spec(spec))

    @staticmethod
    def cuda_count():
        """How many GPUs this process sees (DeviceError without cupy or a driver)."""
        return _load_cupy(0).cuda.runtime.getDeviceCount()

    @property
    def bus_id(self):
        """The GPU's PCI bus id (the same GPU has the same id in every process), None on the
        CPU."""
        return None if self.kind == "cpu" else self.xp.cuda.Device(self.index).pci_bus_id

    # -- autodiff switch ----------------------------------------------------------------------
    def autodiff(self):
        if self._autodiff:
            raise DeviceError(f"{self} already records gradients; "
                              "use dev.inner() for the plain device")
        return Device(self.kind, self.index, True)

    def inner(self):
        return Device(self.kind, self.index, False)

    def is_autodiff(self):
        return self._autodiff

    # -- what the device owns -----------------------------------------------------------------
    @property
    def xp(self):
        return self._state.xp

    @property
    def memory(self):
        return self._state.memory

    @property
    def rng(self):
        return self._state.rng

    def seed(self, n):
        """Reset the device's random generator; the same seed gives the same numbers."""
        self._state.seed_value = int(n)
        self._state.rng = _make_rng(self.kind, self.xp, int(n))

    def rng_state(self):
        """The generator's state as JSON-able data (checkpoints, recomputed dropout)."""
        rng = self._state.rng
        return rng.state if isinstance(rng, CountingRng) else rng.bit_generator.state

    def set_rng_state(self, state):
        """Continue the stream rng_state() saved. A state the other kind of device saved (a run
        resumed on it with resume_allow: [device]) cannot go on here: the generator is seeded
        from it instead, with a warning, since dropout then draws other masks than an
        uninterrupted run would."""
        rng = self._state.rng
        counting = is_counting_state(state)
        if counting != isinstance(rng, CountingRng):
            text = json.dumps(state, sort_keys=True, default=str).encode()
            self.seed(int(hashlib.sha256(text).hexdigest()[:15], 16))
            warnings.warn(f"{self}: the saved random state is another device's "
                          f"({'cuda' if counting else 'cpu'}); its stream cannot go on here, "
                          "so dropout continues from a seed made from it", stacklevel=2)
        elif counting:
            rng.state = state
        else:
            rng.bit_generator.state = state

    @property
    def tf32(self):
        """Whether float32 products on this device may use TF32 tensor cores (never on a CPU)."""
        return self.kind == "cuda" and tf32_enabled(self.xp)

    def set_tf32(self, on):
        """Let float32 products on the GPU (cupy's matmuls and packlora's decoded tiles) use TF32
        tensor cores, or not; process-wide, as cupy's switch is. A GPU without them (compute
        capability below 8.0) stays in float32, with a warning."""
        if self.kind == "cpu":
            if on:
                raise DeviceError("tf32 needs a CUDA device: TF32 is a tensor-core format of "
                                  "NVIDIA GPUs, the CPU computes in float32")
            return
        linalg = self.xp._core._routines_linalg
        with warnings.catch_warnings():  # cupy's own warning on an older GPU: ours says more
            warnings.simplefilter("ignore")
            self.xp._core.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32 if on
                                           else linalg.COMPUTE_TYPE_DEFAULT)
        if on and not self.tf32:
            warnings.warn(f"tf32: {self} has no TF32 tensor cores (compute capability below "
                          "8.0); its products stay float32", stacklevel=2)

    def sync(self):
        if self.kind == "cuda":
            self.xp.cuda.Device(self.index).synchronize()

    @property
    def scratch_cap(self):
        return self._state.scratch_cap

    def set_scratch_cap(self, nbytes):
        """Bytes of dense scratch the packed kernels may hold (reallocated on next use)."""
        self._state.scratch_cap = int(nbytes)
        self._state.scratch = None

    def scratch(self, nelem, dtype):
        """A reused flat buffer of at least `nelem` items, counted under `dense_scratch`."""
        st = self._state
        dtype = np.dtype(dtype)
        need = nelem * dtype.itemsize
        buf = st.scratch
        if buf is None or buf.nbytes < need:
            st.scratch = buf = None  # free the smaller buffer before taking the larger one
            buf = self.xp.empty(max(need, 1), dtype=np.uint8)
            st.scratch = self.memory.track(buf, "dense_scratch")
        return buf[:need].view(dtype)

    # -- identity -----------------------------------------------------------------------------
    def __eq__(self, other):
        return (isinstance(other, Device) and self.kind == other.kind
                and self.index == other.index and self._autodiff == other._autodiff)

    def same_hardware(self, other):
        return self.kind == other.kind and self.index == other.index

    def __hash__(self):
        return hash((self.kind, self.index, self._autodiff))

    def __str__(self):
        base = "cpu" if self.kind == "cpu" else f"cuda:{self.index}"
        return base + ("+autodiff" if self._autodiff else "")

    def __repr__(self):
        return f"Device({str(self)!r})"
