"""The CUDA kernels as a GPU would compile them (Numba-CUDA -> PTX -> ptxas for sm_90), with no
GPU: bench/cuda_static.py in the environment scripts/test.sh makes where a CUDA toolkit (ptxas,
libnvvm) is installed. Guards what the simulator cannot see: local memory, spills, registers;
and, through bench/cuda_launch_host.py (Numba-CUDA with the driver stubbed), the parameters a
replayed launch passes (kernels/cuda/prepared.py)."""
import json
import os
import textwrap
from pathlib import Path

import pytest
from at_once import run_at_once, workers

BENCH = Path(__file__).resolve().parents[1] / "bench" / "cuda_static.py"
LAUNCH_HOST = BENCH.parent / "cuda_launch_host.py"
COMPILE_PY = os.environ.get("PACKLORA_CUDA_COMPILE_PY")
# What products of up to 16 rows and the row gather launch, 256 threads a block. Not held to
# the register bound: the GEMV for up to 16 rows (the benchmark's; 64 sums a thread backward)
# and the large-M tile (on a GPU with a scratch, M > 16 goes to cuBLAS)
SMALL_M_KERNELS = ("gemv_fwd", "gemv_bwd", "tile_small_m", "gather_rows")
KERNELS = (*SMALL_M_KERNELS, "gemv_fwd_16", "gemv_bwd_16", "tile_large_m", "decode_run",
           "decode_group", "scatter_rows")
# sm_90 has 65,536 registers a multiprocessor: at most 128 a thread lets two blocks of 256 share
# one (the small-M tile had 117 when it carried every format's decoder)
MAX_REGISTERS = 128


def _run_at_once(arg_lists, timeout=900):
    """stdout of COMPILE_PY with each list of arguments, run at once (skips without the
    compile environment)."""
    if not COMPILE_PY:
        pytest.skip("no CUDA compile environment: scripts/test.sh makes one where the CUDA "
                    "toolkit's ptxas and libnvvm are installed (PACKLORA_CUDA_COMPILE_PY)")
    env = dict(os.environ, CUDA_HOME=os.environ.get("PACKLORA_CUDA_HOME", "/usr/local/cuda"))
    return run_at_once([[COMPILE_PY, *map(str, args)] for args in arg_lists], timeout, env=env,
                       cwd=BENCH.parent)


def _run(*args, timeout=900):
    return _run_at_once([args], timeout)[0]


@pytest.fixture(scope="module")
def compiled():
    """Every kernel for every format, the formats shared among processes run at once."""
    n = workers()
    outs = _run_at_once([(BENCH, "--formats", "all", "--kernels", ",".join(KERNELS),
                          "--shard", f"{i}/{n}") for i in range(n)])
    got = {name: res for out in outs for name, res in json.loads(out)["kernels"].items()}
    assert len(got) == (len(KERNELS) - 1) * len(_formats(got)) + 1, sorted(got)  # scatter_rows
    return got


def _formats(compiled):
    """The formats `compiled` holds kernels for ("kernel/format" names)."""
    return {name.split("/")[1] for name in compiled if "/" in name}


def test_no_local_memory_or_spills(compiled):
    for name, res in compiled.items():
        assert res["stack_bytes"] == 0 and res["ptx_local_accesses"] == 0, (name, res)
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, (name, res)


def test_no_kernel_adds_by_atomics(compiled):
    """Split reductions write a part per block, summed in a fixed order: a float atomic add
    lands in an order that varies between runs, and a resume would not be bit-exact. The only
    atomics are the split products' integer counters (parts.py), one a block."""
    for name, res in compiled.items():
        assert res["ptx_float_atomics"] == 0, (name, res)
        splits = name.split("/")[0] in ("gemv_bwd", "gemv_bwd_16", "tile_small_m",
                                        "tile_large_m")
        assert res["ptx_atomics"] == (1 if splits else 0), (name, res)


def test_two_blocks_fit_a_multiprocessor(compiled):
    for name, res in compiled.items():
        if name.split("/")[0] in SMALL_M_KERNELS:
            assert res["registers"] <= MAX_REGISTERS, (name, res)


def test_a_tiles_blocks_bound_its_registers():
    """A Tile's `blocks` reaches ptxas as launch bounds: the small-M tile held to three blocks
    of 256 threads (ops.SMALL_M_CANDIDATES) fits in a third of a multiprocessor's registers,
    where NF4 + DQ and Q4_K take 95 unbounded."""
    out = json.loads(_run(BENCH, "--formats", "nf4+dq,q4_k", "--kernels", "tile_3_blocks"))
    assert len(out["kernels"]) == 2
    for name, res in out["kernels"].items():
        assert res["registers"] <= 65536 // (256 * 3), (name, res)


def test_tiles_differing_in_launch_bounds_have_cache_keys_of_their_own():
    """Numba keys a kernel's on-disk cache entry by its bytecode and closure values, not its
    launch bounds: SMALL_M_TILE and the same tile held to three blocks must differ there, or a
    warm cache hands one the other's code."""
    code = textwrap.dedent("""
        from packlora.kernels.cuda.gemm import gemm_kernel
        from packlora.kernels.cuda.ops import SMALL_M_CANDIDATES, SMALL_M_TILE
        from packlora.kernels.format_ids import FORMAT_IDS

        def key(tile):
            kernel = gemm_kernel(tile)(FORMAT_IDS["q4_k"], 0)
            return (kernel.py_func.__code__.co_code,
                    repr([c.cell_contents for c in kernel.py_func.__closure__]))
        print(key(SMALL_M_TILE) != key(SMALL_M_CANDIDATES["tile_3_blocks"]))
    """)
    assert _run("-c", code).strip() == "True"


def test_a_scale_group_reads_its_scales_once(compiled):
    formats = _formats(compiled)
    assert len(formats) >= 15, sorted(formats)  # every format, nf4 / fp4 also double-quantized
    for fmt in formats:
        run, group = (compiled[f"{k}/{fmt}"]["ptx_instructions"]
                      for k in ("decode_run", "decode_group"))
        assert group < run, (fmt, group, run)


def test_replayed_launches_pass_what_numba_passes():
    """GEMV forward, backward and row gather at M = 1, the small-M tile forward and backward at
    M = 16, for a flat, a K-quant and a ggml block format: after the first launch each call is
    replayed, and cuda.core gets the stream, grid, block, options, kernel and every parameter
    Numba's ordinary launch gives it for the same arrays."""
    rows = json.loads(_run(LAUNCH_HOST, "--rounds", "1", "--reps", "2"))["results"]
    assert len(rows) == 3 * 5, rows
    for row in rows:
        assert row["same_params"] and row["launches"] == row["replays"] == 1, row


MISMATCH = textwrap.dedent("""
    import json, warnings
    import numpy as np
    from cuda_stubs import on_stand_in, prepared, stub_driver
    from cuda_launch_host import launches, products, random_packed

    recorder = stub_driver((9, 0))
    rng = np.random.default_rng(0)
    w = on_stand_in(random_packed("q8_0", 64, 256, rng))
    fwd = products(w, 1, "gemv", rng)["fwd"]
    ours = prepared.array_params   # marshalled otherwise than Numba: data pointer + 4
    prepared.array_params = lambda v: [p + 4 * (i == 4) for i, p in enumerate(ours(v))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, again = (launches(recorder, fwd, True) for _ in range(2))
    prepared.array_params = ours
    ordinary = launches(recorder, fwd, False)
    print(json.dumps({"warnings": [str(c.message) for c in caught
                                   if "packlora" in str(c.message)], "replays":
                      recorder.replays, "same": first == again == ordinary}))
""")


def test_a_marshalling_that_differs_keeps_the_ordinary_launch():
    got = json.loads(_run("-c", MISMATCH, timeout=300))
    assert got["replays"] == 0 and got["same"], got
    warned = got["warnings"]
    assert len(warned) == 1 and "otherwise than packlora replays" in warned[0], got
