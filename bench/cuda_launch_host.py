"""The host side of packlora's GPU launches, without a GPU: what each launch passes to cuda.core,
and the host time of a packed product at small M through Numba's ordinary launch and through a
replayed one (kernels/cuda/prepared.py), as JSON.

Runs the real entry points (linear_fwd, linear_bwd, gather_rows) with Numba-CUDA compiling
every kernel (NVVM, as on a GPU), on stand-in cupy arrays and with the driver's parts stubbed
(bench/cuda_stubs.py): cuda.core's launch records what it is given instead. So:
  - "same_params": for each kernel, the replayed launch passes exactly what Numba's ordinary
    launch passes on the same arrays (stream, grid, block, options, kernel, every parameter);
  - "*_host_us": the host time per product up to the driver call, taking turns, ordinary vs
    replayed. The driver call itself (cuda.core's launch, the same on both paths) is not in it.

Needs Numba-CUDA with libnvvm (CUDA_HOME), no driver, no device, no cupy:
  CUDA_HOME=/usr/local/cuda $CACHE/cuda-compile-venv/bin/python bench/cuda_launch_host.py
"""
import argparse
import json
import sys
import time

import numpy as np
from cuda_stubs import cupy, on_stand_in, stub_driver  # before packlora: the stand-in cupy
from kernels import random_packed  # bench/kernels.py
from packlora.kernels.cuda import launch, ops, rows

FORMATS = ("nf4+dq", "q4_k", "q8_0")
CASES = (("gemv", 1), ("tile", 16))  # (kernel a product of M rows takes, M)
SCRATCH_ELEMS = 1 << 20  # float32: more than the parts of these products take


def products(w, m, kernel, rng):
    """{name: call} for one weight at M rows: forward, backward (and the row gather), each
    into an output of its own (the same arrays on both paths)."""
    n, k = w.shape
    x = cupy.asarray(rng.standard_normal((m, k), dtype=np.float32))    # (M, K)
    dy = cupy.asarray(rng.standard_normal((m, n), dtype=np.float32))   # (M, N)
    y, dx = cupy.empty((m, n), np.float32), cupy.empty((m, k), np.float32)
    tile = None if kernel == "gemv" else ops.SMALL_M_TILE
    scratch = cupy.empty(SCRATCH_ELEMS, np.float32)  # a Device's: the parts of split reductions
    parts = {"scratch": lambda nelem: scratch[:nelem], "cap_elems": SCRATCH_ELEMS}
    calls = {"fwd": lambda: ops.linear_fwd(x, w, y, tile=tile, **parts),
             "bwd": lambda: ops.linear_bwd(dy, w, dx, tile=tile, **parts)}
    if kernel == "gemv":
        picked, out = cupy.arange(0, m, dtype=np.int64), cupy.empty((m, k), np.float32)
        calls["gather"] = lambda: rows.gather_rows(w, picked, out)
    return calls


def launches(recorder, call, replayed):
    """What one call passed to cuda.core, ordinary or replayed launches."""
    launch.PREPARED_LAUNCHES = replayed
    start = len(recorder.calls)
    call()
    return recorder.calls[start:]


def _host_us(recorder, call, replayed, reps):
    launch.PREPARED_LAUNCHES = replayed
    recorder.keep = False
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    elapsed = time.perf_counter() - t0
    recorder.keep = True
    return elapsed / reps * 1e6


def bench(recorder, fmt, n, k, rounds, reps, rng):
    w = on_stand_in(random_packed(fmt, n, k, rng))
    rows_out = []
    for kernel, m in CASES:
        for op, call in products(w, m, kernel, rng).items():
            ordinary = launches(recorder, call, False)
            launches(recorder, call, True)       # the first: ordinary, then prepared
            before = recorder.replays
            replayed = launches(recorder, call, True)
            replays = recorder.replays - before
            times = {True: [], False: []}
            for _ in range(rounds):                # taking turns
                for side in (False, True):
                    times[side].append(_host_us(recorder, call, side, reps))
            ordinary_us, replayed_us = (float(np.median(times[s])) for s in (False, True))
            rows_out.append({"format": fmt, "N": n, "K": k, "M": m, "kernel": kernel,
                             "op": op, "launches": len(replayed), "replays": replays,
                             "same_params": ordinary == replayed and len(ordinary) > 0,
                             "ordinary_host_us": round(ordinary_us, 1),
                             "replayed_host_us": round(replayed_us, 1),
                             "ratio": round(replayed_us / ordinary_us, 3)})
            print(json.dumps(rows_out[-1]), file=sys.stderr, flush=True)
    return rows_out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default="9.0")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shape", default="4096,4096", help="N,K of the weight")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    recorder = stub_driver(tuple(int(p) for p in args.cc.split(".")))
    n, k = (int(v) for v in args.shape.split(","))
    rng = np.random.default_rng(0)
    results = [row for fmt in args.formats.split(",")
               for row in bench(recorder, fmt, n, k, args.rounds, args.reps, rng)]
    print(json.dumps({"cc": args.cc, "note": "host time up to cuda.core's launch (stubbed)",
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
