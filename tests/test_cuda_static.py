"""The CUDA kernels as a GPU would compile them (Numba-CUDA -> PTX -> ptxas for sm_90), with no
GPU: bench/cuda_static.py in the environment scripts/test.sh makes where a CUDA toolkit (ptxas,
libnvvm) is installed. Guards what the simulator cannot see: local memory, spills, registers."""
import json
import os
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "cuda_static.py"
COMPILE_PY = os.environ.get("PACKLORA_CUDA_COMPILE_PY")
# What products of up to 16 rows and the row gather launch, 256 threads a block. Not held to
# the register bound: the GEMV for up to 16 rows (the benchmark's; 64 sums a thread backward)
# and the large-M tile (on a GPU with a scratch, M > 16 goes to cuBLAS)
SMALL_M_KERNELS = ("gemv_fwd", "gemv_bwd", "tile_small_m", "gather_rows")
KERNELS = (*SMALL_M_KERNELS, "gemv_fwd_16", "gemv_bwd_16", "tile_large_m", "decode_run",
           "decode_group")
# sm_90 has 65,536 registers a multiprocessor: at most 128 a thread lets two blocks of 256 share
# one (the small-M tile had 117 when it carried every format's decoder)
MAX_REGISTERS = 128


@pytest.fixture(scope="module")
def compiled():
    if not COMPILE_PY:
        pytest.skip("no CUDA compile environment: scripts/test.sh makes one where the CUDA "
                    "toolkit's ptxas and libnvvm are installed (PACKLORA_CUDA_COMPILE_PY)")
    env = dict(os.environ, CUDA_HOME=os.environ.get("PACKLORA_CUDA_HOME", "/usr/local/cuda"))
    proc = subprocess.run([COMPILE_PY, str(BENCH), "--formats", "all", "--kernels",
                           ",".join(KERNELS)], capture_output=True, text=True, timeout=900,
                          check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)["kernels"]


def test_no_local_memory_or_spills(compiled):
    for name, res in compiled.items():
        assert res["stack_bytes"] == 0 and res["ptx_local_accesses"] == 0, (name, res)
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, (name, res)


def test_two_blocks_fit_a_multiprocessor(compiled):
    for name, res in compiled.items():
        if name.split("/")[0] in SMALL_M_KERNELS:
            assert res["registers"] <= MAX_REGISTERS, (name, res)


def test_a_scale_group_reads_its_scales_once(compiled):
    formats = {name.split("/")[1] for name in compiled}
    assert len(formats) >= 15, sorted(formats)  # every format, nf4 / fp4 also double-quantized
    for fmt in formats:
        run, group = (compiled[f"{k}/{fmt}"]["ptx_instructions"]
                      for k in ("decode_run", "decode_group"))
        assert group < run, (fmt, group, run)
