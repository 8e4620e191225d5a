"""Data-parallel training over MPI (mpi4py): the world of ranks this process belongs to.

Under `mpiexec -n N` (or srun, or mpirun with a hostfile) every rank runs the same fine-tune on
its share of each global batch; the adapter gradients and the target counts are summed with one
Allreduce per step, so the update is exactly that of one process with the whole batch. Outside
an MPI launcher the world is this process alone and nothing here costs anything.
"""
import hashlib
import json
import os
import sys
import time

import numpy as np

from ..device import Device, parse_spec
from ..errors import ConfigError

ABORT_GRACE_S = 0.5  # seconds a failing rank waits before MPI Abort, for its output to get out

# Environment variables an MPI launcher sets on every rank (MPICH/Hydra, Open MPI, PMIx, Slurm).
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")
_MPI_HINT = "pip install 'packlora[mpi]' (mpi4py and the mpich MPI)"


def launched_ranks():
    """How many ranks the MPI launcher started (1 when not under a launcher)."""
    for var in _SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 1


def check_global_batch(batch_size, ranks):
    """ConfigError unless the global batch splits evenly over the ranks."""
    if ranks < 1 or batch_size % ranks:
        raise ConfigError(f"train.batch_size: {batch_size} is the global batch and must divide "
                          f"by the {ranks} ranks")


def rank_gpu(index, node_rank, count):
    """The GPU of the node_rank-th rank on a node whose config says cuda:index: the ranks take
    the GPUs from there in turn, wrapping at the count this rank sees (one each where the
    launcher gives every rank its own GPU through CUDA_VISIBLE_DEVICES)."""
    return (index + node_rank) % count


def shared_gpu(bus_ids):
    """(rank a, rank b, bus id) for the first two ranks of a node on one GPU, else None."""
    first = {}
    for rank, bus in enumerate(bus_ids):
        if bus in first:
            return first[bus], rank, bus
        first[bus] = rank
    return None


class World:
    """Rank, size and the collectives the trainer needs; size 1 means one process, no MPI."""

    def __init__(self, comm=None, mpi=None):
        self.comm, self.mpi = comm, mpi
        self._nccl_sum = None
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1

    @classmethod
    def detect(cls):
        """The MPI world when launched by mpiexec/srun (mpi4py required then), else one rank."""
        if launched_ranks() <= 1:
            return cls()
        try:
            from mpi4py import MPI  # noqa: PLC0415  (optional: only under an MPI launcher)
        except ImportError:
            raise ConfigError(f"this process was started by an MPI launcher "
                              f"({launched_ranks()} ranks) but mpi4py is not installed: "
                              f"{_MPI_HINT}") from None
        comm = MPI.COMM_WORLD
        comm.Set_errhandler(MPI.ERRORS_ARE_FATAL)  # a broken peer ends the job, never a hang
        return cls(comm, MPI)

    @property
    def is_main(self):
        return self.rank == 0

    def shard(self, n):
        """The half-open slice of a global batch of n rows that this rank takes."""
        return slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)

    def node(self):
        """This rank's (rank, ranks) among the ranks on its machine (MPI's shared-memory split),
        and that communicator (None for one process)."""
        if self.size == 1:
            return 0, 1, None
        node = self.comm.Split_type(self.mpi.COMM_TYPE_SHARED)
        return node.Get_rank(), node.Get_size(), node

    def device(self, spec):
        """The device this rank trains on. Several ranks on a machine with `device: cuda:N` take
        GPUs N, N+1, ... (rank_gpu); two of them on one GPU, which NCCL refuses, are a
        ConfigError naming them."""
        kind, index, autodiff = parse_spec(spec)
        if self.size == 1 or kind != "cuda":
            return Device(kind, index, autodiff)
        local, ranks, node = self.node()
        try:
            count = Device.cuda_count()
            dev = Device(kind, rank_gpu(index, local, count), autodiff)
            clash = shared_gpu(node.allgather(dev.bus_id))
        finally:
            node.Free()
        if clash is not None:
            raise ConfigError(f"device: {spec} with {ranks} ranks on this machine: its ranks "
                              f"{clash[0]} and {clash[1]} would share GPU {clash[2]} "
                              f"({count} visible to each); start at most one "
                              "rank per GPU, or give each its own through CUDA_VISIBLE_DEVICES")
        return dev

    # -- collectives --------------------------------------------------------------------------
    def sum_scalars(self, *values):
        """The sums of a few numbers over all ranks (one Allreduce)."""
        if self.size == 1:
            return values
        buf = np.asarray(values, dtype=np.float64)
        out = np.empty_like(buf)
        self.comm.Allreduce(buf, out)
        return tuple(out.tolist())

    def sum_grads(self, params, flat):
        """Sum every parameter's gradient over the ranks through `flat`, one float32 buffer
        holding them all; afterwards each parameter has the same (summed) .grad everywhere."""
        if self.size == 1:
            return
        o = 0
        for _, p in params:
            n = p.data.size
            flat[o:o + n] = 0.0 if p.grad is None else p.grad.data.reshape(-1)
            o += n
        if isinstance(flat, np.ndarray):
            self.comm.Allreduce(self.mpi.IN_PLACE, flat)
        else:  # a GPU buffer: summed by NCCL, device to device
            self._nccl().sum_(flat)
        o = 0
        for _, p in params:
            n = p.data.size
            g = flat[o:o + n].reshape(p.data.shape)
            if p.grad is None:
                p.grad = type(p)(g.copy(), p.device.inner())
            else:
                p.grad.data[...] = g
            o += n

    def _nccl(self):
        if self._nccl_sum is None:
            self._nccl_sum = NcclSum(self)
        return self._nccl_sum

    def broadcast(self, obj):
        """Rank 0's `obj` (any picklable value) on every rank."""
        return obj if self.size == 1 else self.comm.bcast(obj, root=0)

    def broadcast_arrays(self, arrays):
        """Rank 0's values into each array of `arrays` (same shapes on every rank), in place."""
        if self.size == 1:
            return
        for a in arrays:
            if isinstance(a, np.ndarray):
                self.comm.Bcast(a, root=0)
            else:  # a GPU array: through the host
                host = a.get()
                self.comm.Bcast(host, root=0)
                a.set(host)

    def gather(self, obj):
        """[obj of rank 0, ..., obj of rank N-1] on rank 0 (None elsewhere)."""
        return [obj] if self.size == 1 else self.comm.gather(obj, root=0)

    def check_same(self, what, value,
                   hint="start every rank with the same config and overrides"):
        """ConfigError on every rank unless `value` (e.g. the resolved config) is the same on all
        ranks; compared by hash."""
        if self.size == 1:
            return
        digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode())
        hashes = self.comm.allgather(digest.hexdigest()[:16])
        if len(set(hashes)) > 1:
            raise ConfigError(f"the {self.size} ranks were given different {what} "
                              f"(hashes by rank: {', '.join(hashes)}); {hint}")

    def abort(self, code):
        """End every rank now (an error on one rank must not leave the others waiting). The
        launcher kills every rank at the first Abort and can drop what the ranks wrote but it
        had not forwarded yet, so each rank gives it a moment first (an error path only)."""
        sys.stdout.flush()
        sys.stderr.flush()
        if self.size > 1:
            time.sleep(ABORT_GRACE_S)
            self.comm.Abort(code)


class NcclSum:
    """Sums float32 GPU buffers over the ranks with NCCL; its rendezvous id goes over MPI."""

    def __init__(self, world):
        import cupy  # noqa: PLC0415  (only reached with device: cuda under mpiexec)
        from cupy.cuda import nccl  # noqa: PLC0415  (a submodule cupy.cuda does not import)
        if not nccl.available:
            raise ConfigError(f"device: cuda with {world.size} ranks sums the gradients with "
                              "NCCL, which cupy cannot load here: pip install 'packlora[cuda]' "
                              "or 'packlora[cuda13]' (they bring nvidia-nccl)")
        self.cupy, self.nccl = cupy, nccl
        uid = self.nccl.get_unique_id() if world.is_main else None
        self.comm = self.nccl.NcclCommunicator(world.size, world.broadcast(uid), world.rank)

    def sum_(self, flat):
        """flat (a contiguous float32 cupy array) <- its sum over the ranks, in place."""
        stream = self.cupy.cuda.get_current_stream().ptr
        self.comm.allReduce(flat.data.ptr, flat.data.ptr, flat.size, self.nccl.NCCL_FLOAT32,
                            self.nccl.NCCL_SUM, stream)
        self.cupy.cuda.get_current_stream().synchronize()
