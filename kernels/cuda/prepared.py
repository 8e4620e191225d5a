"""Launching a Numba-CUDA kernel again without Numba's per-call argument handling (cupy arrays).

On every launch Numba-CUDA types each argument, looks up the compiled kernel for those types,
and marshals each array into seven kernel parameters (meminfo, parent, size, itemsize, data
pointer, shape, strides) before it calls cuda.core's launch. A packed product passes about
fourteen arrays, ten of them the weight's, which never change between calls; at small M that
host work took longer than the product itself on an H200 (0.4-0.8 ms against 0.04-0.2 ms).

`first_launch` makes one ordinary launch and records what Numba did: the compiled kernel it
chose (a pre-launch callback) and the weight's parameters (Numba's own marshalling). A
`Prepared` launch then replays that kernel with those parameters and marshals only the call's
own arguments: cupy arrays (a few attribute reads) and integers, in Numba's order. The first
launch also marshals the call's own arguments both ways; if they differ (a Numba-CUDA version
that marshals otherwise), that kernel keeps the ordinary launch and a warning says so once.
The callback sits on Numba's shared launch configuration during that first launch only: launches
come from one thread at a time, as everywhere in packlora.
"""
import ctypes
import functools
import warnings

try:  # Numba-CUDA that launches through cuda.core; other versions keep the ordinary launch
    from cuda.core import LaunchConfig
    from cuda.core import launch as core_launch
    from numba.cuda.cudadrv.driver import _to_core_stream
except ImportError:
    core_launch = None


class Prepared:
    """One compiled kernel with one weight's parameters, launched on arguments of one
    signature (`signature(args)`)."""

    def __init__(self, function, int_types, tail):
        self.function = function    # the kernel in the current context (cuda.core's)
        self.int_types = int_types  # {position: ctypes type} of the integer arguments
        self.tail = tail            # the weight's parameters, marshalled by Numba

    def __call__(self, core_stream, grid, block, args):
        core_launch(core_stream, _config(grid, block), self.function,
                    *own_params(args, self.int_types), *self.tail)


def signature(args):
    """What decides the compiled kernel Numba picks for these arguments (integers and arrays):
    int for an integer; an array's type, dtype, rank and layout."""
    return tuple(int if isinstance(v, int) else
                 (type(v), v.dtype, v.ndim, v.flags.c_contiguous, v.flags.f_contiguous)
                 for v in args)


def own_params(args, int_types):
    """A call's own kernel parameters (cupy arrays and integers), in Numba's order."""
    out = []
    for i, v in enumerate(args):
        if isinstance(v, int):
            out.append(int_types[i](v))
        else:
            out += array_params(v)
    return out


def array_params(v):
    """A cupy array's kernel parameters as Numba marshals its device view: no meminfo or
    parent, size, itemsize, data pointer (null when empty), shape, strides (C-contiguous: from
    the shape, as the array interface leaves them out)."""
    shape, itemsize = v.shape, v.itemsize
    strides = _c_strides(shape, itemsize) if v.flags.c_contiguous else v.strides
    return [0, 0, v.size, itemsize, v.data.ptr if v.size else 0, *shape, *strides]


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return strides[::-1]


def first_launch(dispatcher, grid, block, stream, args, views, weight):
    """Launch dispatcher[grid, block, stream](*views, *weight) the ordinary way (args: cupy
    arrays and integers; views: args with cupy arrays as Numba device views) and return a
    Prepared that repeats it for new arguments of the same signature, or None where this
    Numba-CUDA cannot be replayed."""
    config = dispatcher[grid, block, stream]  # Numba keeps it: the callback is taken back
    chosen = []

    def record(kernel, _config):
        chosen.append(kernel)

    callbacks = getattr(config, "pre_launch_callbacks", None)
    if callbacks is None or core_launch is None:
        config(*views, *weight)
        return None
    callbacks.append(record)
    try:
        config(*views, *weight)
    finally:
        callbacks.remove(record)
    if len(chosen) != 1:
        return None
    try:
        return _prepare(chosen[0], stream, args, views, weight)
    except (AttributeError, TypeError, NotImplementedError):  # Numba-CUDA's internals moved
        _warn_once(chosen[0])
        return None


def _prepare(kernel, stream, args, views, weight):
    """A Prepared for `kernel` if Numba marshals `views` as own_params does `args`."""
    if (getattr(kernel, "debug", False) or getattr(kernel, "cooperative", False)
            or getattr(kernel, "launch_config_sensitive", False)
            or getattr(kernel, "extensions", None)):
        return None  # what the ordinary launch does besides marshalling: keep it
    types = kernel.argument_types
    int_types = {i: getattr(ctypes, f"c_{types[i]}") for i, v in enumerate(args)
                 if isinstance(v, int)}
    if not _same(own_params(args, int_types), _numba_params(kernel, types, views, stream)):
        _warn_once(kernel)
        return None
    return Prepared(kernel._codelibrary.get_cufunc().kernel, int_types,
                    _numba_params(kernel, types[len(views):], weight, stream))


def _numba_params(kernel, types, values, stream):
    """The kernel parameters Numba's launch would pass for these arguments."""
    params, writebacks = [], []
    for t, v in zip(types, values):
        kernel._prepare_args(t, v, stream, writebacks, params)
    return params


def _same(ours, numbas):
    """Equal parameter lists: integers by value, ctypes scalars by type and value."""
    def plain(p):
        return (type(p).__name__, p.value) if isinstance(p, ctypes._SimpleCData) else int(p)
    return [plain(p) for p in ours] == [plain(p) for p in numbas]


@functools.cache
def _warn_once(kernel):
    name = getattr(getattr(kernel, "py_func", None), "__qualname__", kernel)
    warnings.warn(f"packlora: Numba-CUDA marshals the arguments of kernel {name} otherwise "
                  f"than packlora replays them; its launches keep Numba's ordinary path "
                  f"(slower at small batches)", RuntimeWarning)


@functools.lru_cache(maxsize=512)
def _config(grid, block):
    return LaunchConfig(grid=grid, block=block)


def core_stream(numba_stream):
    """cuda.core's handle on a Numba stream (what the ordinary launch makes on every call)."""
    return None if core_launch is None else _to_core_stream(numba_stream)
