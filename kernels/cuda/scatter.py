"""Scatter-adds on the GPU that give the same bits on every run: out[idx[i]] += g[i].

cupy's `add.at` (and cupyx's scatter_add) add by float atomics, in an order that changes from
run to run, so an embedding's gradient, or any gradient through advanced indexing, would differ
in its last bits between two identical runs. Here the indices are sorted (stably, so repeats
keep their order), each output element is summed by one thread over its run of repeats, in
that order, and written once: the same additions, in the same order, as numpy's `add.at` on
the CPU.

One thread per (distinct index, column): neighbouring threads take neighbouring columns of one
row (reads and writes coalesced for wide rows) or, for one-column rows, neighbouring rows."""
import math

from numba import cuda

from .launch import launch_plain

THREADS = 256


@cuda.jit(cache=True)
def _run_sums(out, g, order, starts, rows, width):
    """out[rows[s], c] += g[order[j], c] for j in run s (starts[s] <= j < starts[s + 1]),
    added one after another; one thread per (s, c)."""
    t = cuda.grid(1)
    s = t // width
    if s >= rows.shape[0]:
        return
    c = t - s * width
    r = rows[s]
    acc = out[r, c]
    for j in range(starts[s], starts[s + 1]):
        acc += g[order[j], c]
    out[r, c] = acc


def scatter_add(xp, out, index, g):
    """out[index] += g for any index numpy takes, entries repeated or not (advanced indexing),
    as numpy's add.at adds them; out C-contiguous. xp: cupy, or numpy in the simulator. An
    integer array picks whole rows of out (an embedding's ids): one thread a row's value;
    any other index is turned into positions in out, one thread each."""
    if getattr(index, "dtype", None) is not None and index.dtype.kind in "iu":
        idx = xp.asarray(index).reshape(-1)                             # (N,) rows of out
        width = math.prod(out.shape[1:])
        rows = out.reshape(out.shape[0], width)                         # (R, D) view
        g = xp.broadcast_to(g, (*index.shape, *out.shape[1:])).reshape(idx.size, width)
    else:
        idx = xp.arange(out.size).reshape(out.shape)[index]             # where in out g goes
        g = xp.broadcast_to(g, idx.shape).reshape(-1, 1)
        idx, rows = idx.reshape(-1), out.reshape(-1, 1)
    _add_rows(xp, rows, idx, g)
    return out


def _add_rows(xp, out, idx, g):
    """out (R, D) += the rows of g (N, D) at rows idx (N,) of out (negative ones from the end),
    repeats summed in the order they come."""
    n, (size, width) = int(idx.shape[0]), out.shape
    if n == 0 or width == 0:
        return
    if bool(((idx < -size) | (idx >= size)).any()):  # one sync; the kernel would write past out
        raise IndexError(f"scatter_add: indices out of range [-{size}, {size})")
    idx = xp.where(idx < 0, idx + size, idx)                            # (N,) as numpy reads it
    g = g.astype(out.dtype, copy=False)
    order = xp.argsort(idx, kind="stable")                              # (N,)
    sidx = idx[order]                                                   # (N,) sorted
    first = xp.empty(n, dtype=bool)
    first[0] = True
    xp.not_equal(sidx[1:], sidx[:-1], out=first[1:])
    heads = xp.flatnonzero(first)                                       # (S,) run starts
    starts = xp.concatenate((heads, xp.asarray([n], dtype=heads.dtype)))  # (S + 1,)
    rows = sidx[heads]                                                  # (S,)
    blocks = -(-int(rows.shape[0]) * width // THREADS)
    launch_plain(_run_sums, blocks, THREADS, [out, g, order, starts, rows, width], result=0)
