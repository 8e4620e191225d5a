"""Memory tracker: live and peak bytes per category, with an independent process measure.

Imports nothing of packlora: the device owns a tracker, and everything above may use it."""
import contextlib
import os
import resource
import tracemalloc
import weakref

CATEGORIES = (
    "base_packed", "base_other", "dense_scratch", "adapters", "grads", "optimizer",
    "activations", "logits", "kv_cache", "workspace",
)


def _owner(array):
    """The array that owns the memory `array` looks at (views resolve to their base)."""
    base = array
    while getattr(base, "base", None) is not None and hasattr(base.base, "nbytes"):
        base = base.base
    return base


def _peak_hook(base, sample, device_id, name):
    """A memory hook (a subclass of cupy's MemoryHook `base`) that calls sample() after every
    allocation from the pool on GPU `device_id` (cupy calls it for every GPU's; the pool's used
    bytes are those of the GPU allocating); `name` unique among the hooks entered at once
    (cupy's key)."""

    class PeakHook(base):

        def malloc_postprocess(self, **kwargs):
            if kwargs.get("device_id") == device_id:
                sample()

    hook = PeakHook()
    hook.name = name
    return hook


class MemoryTracker:
    """Counts bytes of arrays by category as they are created and freed.

    Arrays are tracked by the buffer that owns their memory, so views are never counted twice.
    The independent measure is tracemalloc on the CPU (numpy reports its allocations to it) and
    cupy's memory pool on a GPU (`pool`, handed in by the device). The pool keeps no peak of its
    own: while measuring, its used bytes are sampled at every allocation from it (tracked
    arrays and the temporaries no category tracks alike), through a memory hook (`hook_base`:
    cupy.cuda.MemoryHook, handed in by the device).
    """

    def __init__(self, kind="cpu", pool=None, hook_base=None, device_id=0):
        self.kind = kind
        self.pool = pool
        self._hook_base = hook_base
        self._device_id = device_id  # the GPU whose allocations the hook samples
        self._hook = None  # the hook entered while measuring on a GPU
        self.current = {c: 0 for c in CATEGORIES}
        self.peak = {c: 0 for c in CATEGORIES}
        self.total = 0
        self.total_peak = 0
        self._live = {}  # id(owner) -> (nbytes, category, weak reference to the owner)
        self._stack = ["workspace"]
        self.enabled = True
        self._pool_peak = None  # max sampled pool.used_bytes() while measuring on a GPU

    # -- categories ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def category(self, name):
        """Arrays tracked inside the block are counted under `name`."""
        if name not in self.current:
            raise ValueError(f"unknown memory category {name!r}; known: {', '.join(CATEGORIES)}")
        self._stack.append(name)
        try:
            yield self
        finally:
            self._stack.pop()

    @property
    def active(self):
        return self._stack[-1]

    # -- tracking -----------------------------------------------------------------------------
    def track(self, array, category=None):
        """Count `array`'s owning buffer under `category` (default: the active one) until freed."""
        if not self.enabled or array is None:
            return array
        owner = _owner(array)
        key = id(owner)
        if key in self._live:
            return array
        nbytes = int(getattr(owner, "nbytes", 0))
        if nbytes == 0:
            return array
        try:  # a plain weak reference kept in the entry: a third of weakref.finalize's cost
            ref = weakref.ref(owner, lambda _, k=key: self._release(k))
        except TypeError:  # objects without weakref support (e.g. a memory map's bytes)
            return array
        cat = category or self._stack[-1]
        self._live[key] = (nbytes, cat, ref)
        self._add(cat, nbytes)
        return array

    def retag(self, array, category):
        """Move an already tracked array to another category (e.g. a gradient kept as .grad)."""
        key = id(_owner(array))
        entry = self._live.get(key)
        if entry is None:
            return self.track(array, category)
        nbytes, old, ref = entry
        if old != category:
            self._add(old, -nbytes)
            self._live[key] = (nbytes, category, ref)
            self._add(category, nbytes)
        return array

    def _add(self, cat, nbytes):
        cur = self.current[cat] + nbytes
        self.current[cat] = cur
        if cur > self.peak[cat]:
            self.peak[cat] = cur
        self.total += nbytes
        if self.total > self.total_peak:
            self.total_peak = self.total

    def _release(self, key):
        entry = self._live.pop(key, None)
        if entry is not None:
            self._add(entry[1], -entry[0])

    # -- reporting ----------------------------------------------------------------------------
    def reset_peak(self):
        """Start a new peak window at the current live bytes (also for the process measure)."""
        self.peak = dict(self.current)
        self.total_peak = self.total
        if self.kind == "cpu" and tracemalloc.is_tracing():
            tracemalloc.reset_peak()
        if self._pool_peak is not None:
            self._pool_peak = self.pool.used_bytes()

    def start_process_measure(self):
        """Turn on the independent measure (tracemalloc on CPU, pool sampling on a GPU); cheap
        to call twice."""
        if self.kind == "cpu" and not tracemalloc.is_tracing():
            tracemalloc.start()
        if self.pool is not None and self._pool_peak is None:
            self._pool_peak = self.pool.used_bytes()
            if self._hook_base is not None:
                self._hook = _peak_hook(self._hook_base, self._sample_pool, self._device_id,
                                        f"packlora_peak_{id(self)}")
                self._hook.__enter__()

    def stop_process_measure(self):
        """Stop the GPU's measure (its memory hook); the CPU's tracemalloc is its caller's."""
        if self._hook is not None:
            self._hook.__exit__(None, None, None)
            self._hook = None
        self._pool_peak = None

    def _sample_pool(self):
        used = self.pool.used_bytes()
        if used > self._pool_peak:
            self._pool_peak = used

    def process_measure(self):
        """(current, peak) bytes from the independent measure, or (None, None) if it is off."""
        if self.kind == "cpu":
            if not tracemalloc.is_tracing():
                return None, None
            return tracemalloc.get_traced_memory()
        if self._pool_peak is None:
            return None, None
        used = self.pool.used_bytes()
        self._pool_peak = max(self._pool_peak, used)
        return used, self._pool_peak

    def snapshot(self):
        """Per-category current and peak bytes, tracked totals and the process measure."""
        proc_cur, proc_peak = self.process_measure()
        return {
            "categories": {c: {"current": self.current[c], "peak": self.peak[c]}
                           for c in CATEGORIES},
            "tracked_current": self.total,
            "tracked_peak": self.total_peak,
            "process_current": proc_cur,
            "process_peak": proc_peak,
            "rss_peak": rss_peak(),
        }


def rss_now():
    """Resident bytes of this process now (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def reset_rss_peak():
    """Linux lets a process reset its peak RSS (VmHWM); elsewhere the lifetime peak stays."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_peak():
    """Peak resident bytes of this process (VmHWM, since the last reset_rss_peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except OSError:
        return None
