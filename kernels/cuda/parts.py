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


@functools.cache
def tile_adder(TM, TC, NT):
    """Device function: c[m0 : m0 + TM, c0 : c0 + TC] = the sum of its parts, in order,
    inside c's edges; NT threads, neighbouring threads on neighbouring columns. A thread's
    sums stay in registers while the parts go by, so its reads of one part are all in flight
    at once (a sum to the end, element after element, would wait on each read in turn)."""
    per = -(-(TM * TC) // NT)  # elements a thread adds up

    @cuda.jit(device=True, cache=True)
    def add(parts, c, m0, c0, mdim, cdim, tid):
        acc = cuda.local.array(per, float32)
        for z in range(parts.shape[0]):
            for i in range(per):
                e = tid + i * NT
                m = m0 + e // TC
                col = c0 + e % TC
                if e < TM * TC and m < mdim and col < cdim:
                    v = parts[z, m, col]
                    acc[i] = v if z == 0 else acc[i] + v
        for i in range(per):
            e = tid + i * NT
            m = m0 + e // TC
            col = c0 + e % TC
            if e < TM * TC and m < mdim and col < cdim:
                c[m, col] = acc[i]

    return add
