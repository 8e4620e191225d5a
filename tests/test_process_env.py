"""The process settings packlora makes at import (src/_env.py): Numba's parallel regions on the
OpenMP layer where it loads, and a user's own settings left alone."""
import json
import os
import subprocess
import sys

_PROBE = """
import json, os
import numpy as np
import packlora
from packlora import _env
import numba
from numba import njit, prange

@njit(parallel=True)
def fill(a):
    for i in prange(a.size):
        a[i] = i

fill(np.zeros(64))
from packlora.kernels.cpu import gemv
print(json.dumps({"layer": numba.threading_layer(), "applied": list(_env.APPLIED),
                  "spin": os.environ.get("GOMP_SPINCOUNT"),
                  "gemv_serial": gemv.serial(1 << 20, bwd=False)}))
"""


def _probe(**env):
    clean = {k: v for k, v in os.environ.items() if k not in (
        "NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          env=clean | env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _omp_loads():
    """Whether Numba's OpenMP layer loads on this machine (asked in a fresh interpreter)."""
    proc = subprocess.run([sys.executable, "-c", "import numba.np.ufunc.omppool"],
                          capture_output=True, timeout=60, check=False)
    return proc.returncode == 0


def test_parallel_regions_run_on_openmp_with_a_short_spin():
    got = _probe()
    assert got["layer"] == ("omp" if _omp_loads() else "workqueue")
    assert got["gemv_serial"] is (got["layer"] == "workqueue")  # 576x1536 at M = 1 gets 2 threads
    assert got["spin"] == "2000" and "GOMP_SPINCOUNT" in got["applied"]


def test_the_user_s_own_threading_settings_win():
    got = _probe(NUMBA_THREADING_LAYER="workqueue", GOMP_SPINCOUNT="0")
    assert got["layer"] == "workqueue" and got["spin"] == "0"
    assert got["gemv_serial"]  # each parallel region costs ~0.1 ms there
    assert "GOMP_SPINCOUNT" not in got["applied"]


def _stderr_of(code, **env):
    clean = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=clean | env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def test_numpy_imported_first_is_said_once():
    late = "numpy was imported before packlora, so the BLAS it loaded started without"
    assert _stderr_of("import numpy; import packlora; import packlora.kernels").count(late) == 1
    assert late not in _stderr_of("import packlora; import numpy")
    assert late not in _stderr_of("import numpy; import packlora", OPENBLAS_THREAD_TIMEOUT="1")
