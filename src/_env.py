"""Thread-pool settings that must be in place before numpy or numba are imported."""
import os

# Numba's default OpenMP pool spins after each kernel and steals the cores OpenBLAS needs;
# the workqueue layer does not. OpenBLAS threads go to sleep quickly between calls.
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
