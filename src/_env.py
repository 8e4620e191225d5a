"""Process settings that must be in place before numpy or numba are imported."""
import ctypes
import os
import sys
import warnings

# Numba's parallel regions run on GNU OpenMP threads that spin briefly (GOMP_SPINCOUNT, which
# outranks OMP_WAIT_POLICY) and then sleep: a region starts in ~2 us, where the workqueue layer
# takes ~100 us, and the threads are asleep long before OpenBLAS needs the cores (OpenMP's
# default spin steals them: a 2x slower step). Where the omp layer cannot load, workqueue
# (tbb, last, is not measured here). GNU OpenMP is not fork-safe: a forked child that runs a
# parallel kernel is ended by Numba (README: use spawn/forkserver, or the workqueue layer).
# OpenBLAS threads go to sleep quickly between calls too.
DEFAULTS = {"NUMBA_THREADING_LAYER_PRIORITY": "omp workqueue tbb", "GOMP_SPINCOUNT": "2000",
            "OPENBLAS_THREAD_TIMEOUT": "1", "OMP_WAIT_POLICY": "passive"}
# the variables set here rather than by the user: a benchmark's peer process runs without them
APPLIED = tuple(var for var in DEFAULTS if var not in os.environ)
for _var in APPLIED:
    os.environ[_var] = DEFAULTS[_var]

# numpy imported first has started OpenBLAS, whose threads read OPENBLAS_THREAD_TIMEOUT as they
# start: they keep spinning after each call and slow the Numba kernels that alternate with BLAS,
# up to 2x at small batches (a benchmark that imported numpy first, 73a4c28). Said once, here.
LATE_FOR_BLAS = "numpy" in sys.modules and "OPENBLAS_THREAD_TIMEOUT" in APPLIED
if LATE_FOR_BLAS:
    warnings.warn("numpy was imported before packlora, so the BLAS it loaded started without "
                  "packlora's thread settings (OpenBLAS's threads then spin between calls, which "
                  "made packlora's kernels up to 2x slower at small batches): import packlora "
                  "first, or set OPENBLAS_THREAD_TIMEOUT=1 before Python starts",
                  RuntimeWarning, stacklevel=2)

# Threads: PACKLORA_THREADS sets the BLAS and Numba pools outright. Under an MPI launcher the
# cores of a host are shared by its ranks (MPICH/Hydra, Open MPI and Slurm say how many run
# here), so each rank takes cores / ranks-on-this-host unless the user set the pools himself.
_POOLS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
_LOCAL_RANKS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def local_ranks():
    """How many ranks of an MPI-launched run share this machine, as the launcher says (1
    without one)."""
    return next((int(v) for k in _LOCAL_RANKS if (v := os.environ.get(k, "")).isdigit()), 1)


def _set_threads():
    forced = os.environ.get("PACKLORA_THREADS", "")
    if forced.isdigit() and int(forced) > 0:
        for var in _POOLS:
            os.environ[var] = forced
        return
    local = local_ranks()
    if local > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
        for var in _POOLS:
            os.environ.setdefault(var, str(max(1, cores // local)))


_set_threads()

# glibc hands large arrays back to the OS on free and page-faults them in again on the next
# step (5-10% of a SmolLM2 training step). Keeping freed arrays up to these sizes in the heap
# lets the next step reuse them. PACKLORA_MALLOC_TUNING=0 leaves glibc's defaults.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 512 << 20


def _tune_malloc():
    if not sys.platform.startswith("linux") or os.environ.get("PACKLORA_MALLOC_TUNING") == "0":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    except (OSError, AttributeError):  # not glibc (e.g. musl): its defaults stay
        pass


_tune_malloc()
