"""The parts of a reduction split over blocks, added up by the block that finishes last.

A product of few rows splits its reduction across blocks to fill the GPU; each block writes the
part it summed (parts[z], in the scratch). Atomic adds into the output would order the
additions by the blocks' finishing times, which change from run to run; adding the parts in a
launch of their own costs that launch (host work, at small M, longer than the product). So each
block, once its part is written, counts itself in on its output tile's counter (an integer
atomic: the count does not depend on the order), and the block that counts last adds the
tile's parts in the order z = 0, 1, ... and writes the output: the same bits on every run, in
one launch. It then sets the counter back to zero for the next launch.

The counters are one int32 array per device and stream (launch.counters), shared by the
launches on that stream, which run one after another."""
import functools

from numba import cuda, float32, int32


@cuda.jit(device=True, cache=True)
def last_to_arrive(counts, slot, nparts, tid):
    """Call in every thread of a block after it wrote its part: True in all of them in the
    block that arrives last among the nparts blocks counting on counts[slot]."""
    done = cuda.shared.array(1, int32)
    cuda.threadfence()  # this thread's part seen by the whole GPU before the block counts
    cuda.syncthreads()
    if tid == 0:
        last = cuda.atomic.add(counts, slot, 1) == nparts - 1
        if last:
            counts[slot] = 0  # ready for the next launch
        done[0] = 1 if last else 0
    cuda.syncthreads()
    last = done[0] != 0
    if last:
        cuda.threadfence()  # the other blocks' parts read after their counts were seen
    return last


# The block that adds a tile's parts reads every one of them alone, each read an L2 round trip.
# So a thread reads a batch before it adds the first (in order all the same): IN_FLIGHT values
# at once (about as many registers), GROUP elements of its own and IN_FLIGHT / GROUP parts of
# each (a thread with 4 elements and 8 parts waits twice where it waited 8 times, the GEMV's
# thread at M = 1 with 128 parts 32 times where it waited 128).
IN_FLIGHT = 16
GROUP = 4


@functools.cache
def tile_adder(TM, TC, NT, in_flight=IN_FLIGHT):
    """Device function: c[m0 : m0 + TM, c0 : c0 + TC] = the sum of its parts, in the order
    z = 0, 1, ..., inside c's edges; NT threads, neighbouring threads on neighbouring columns.
    A thread's elements go GROUP at a time, their sums in registers, and each batch of reads
    (in_flight values, `batch` parts of each) is in flight together."""
    per = -(-(TM * TC) // NT)  # elements a thread adds up
    group = min(per, GROUP)
    batch = max(1, in_flight // group)
    shape = (batch, group)  # local array shapes: compile-time constants

    @cuda.jit(device=True, cache=True)
    def spot(i, m0, c0, mdim, cdim, tid):
        """(row, column) of a thread's element i; column -1 past c's or the tile's edges."""
        e = tid + i * NT
        m = m0 + e // TC
        col = c0 + e % TC
        return m, (col if e < TM * TC and m < mdim and col < cdim else -1)

    @cuda.jit(device=True, cache=True)
    def add(parts, c, m0, c0, mdim, cdim, tid):
        acc = cuda.local.array(group, float32)
        got = cuda.local.array(shape, float32)
        nparts = parts.shape[0]
        for g in range(0, per, group):
            for z0 in range(0, nparts, batch):
                for u in range(batch):
                    for j in range(group):
                        m, col = spot(g + j, m0, c0, mdim, cdim, tid)
                        v = float32(0.0)  # past the edges: summed, never written
                        if z0 + u < nparts and col >= 0:
                            v = parts[z0 + u, m, col]
                        got[u, j] = v
                for u in range(batch):
                    if z0 + u < nparts:
                        for j in range(group):
                            acc[j] = got[u, j] if z0 + u == 0 else acc[j] + got[u, j]
            for j in range(group):
                m, col = spot(g + j, m0, c0, mdim, cdim, tid)
                if col >= 0:
                    c[m, col] = acc[j]

    return add
