"""GPU packed linear (forward y = x @ W.T and backward dx = dy @ W) against cuBLAS, as JSON.

Three ways to the same product, taking turns call by call (CUDA-event times, median and best;
"_host_ms": the host time a call took to return, launches queued):
  packed        packlora's entry point with a Device: fused decode-and-multiply for M <= 16,
                decoded tiles of W (at most the device's scratch) through cuBLAS above;
  deq_cublas    decode the whole W into a fresh dense array (packlora's row gather), then
                cuBLAS (what bitsandbytes does per matmul, the dense copy included);
  dense         cuBLAS on a dense W that already exists (the floor: no decode at all);
  gemv, tile    at M <= 16, each of the two small-M kernels, whichever `packed` picks;
  gemv_rows2    at M <= GEMV_MAX_M, backward only: the GEMV with two rows of W decoded at a
                time (gemv.BWD_ROWS), their reads in flight together;
  tile_*        at 4 < M <= 16, the tile kernel with each of ops.SMALL_M_CANDIDATES instead of
                ops.SMALL_M_TILE (which the next SMALL_M_TILE should be);
  ordinary      at M <= 16, `packed` with every launch through Numba's ordinary path (typing
                and marshalling each argument; packlora replays a prepared launch instead);
  sum_after     at M <= 16, `packed` with a split reduction's parts added by a cupy sum after
                the launch, not by the last block of each output tile in it
                (ops.SUM_PARTS_IN_KERNEL);
  *_tf32        at M > 16, packed and deq_cublas again with TF32 tensor cores on (cupy's
                float32 compute type, Device.set_tf32), taking turns in a pass of their own:
                cuBLAS on both sides at that precision.
Otherwise float32 (cuBLAS). Weights are random codes with small scales (timing does not depend
on the values); each result is checked against the dense float32 product.

Usage: python bench/kernels_cuda.py [--formats nf4+dq,q4_k,q8_0] [--ms 1,16,512,4096] [--reps 10]
"""
import argparse
import json
import sys
import time

import packlora  # noqa: F401, I001  (first: thread settings before numpy loads OpenBLAS)
import numpy as np
from kernels import random_packed  # bench/kernels.py: random codes for every format
from packlora import Device
from packlora.kernels import dequantize_rows, linear_bwd, linear_fwd
from packlora.kernels.cuda import gemv as cuda_gemv
from packlora.kernels.cuda import launch as cuda_launch
from packlora.kernels.cuda import ops as cuda_ops

SHAPES = {"attn": (4096, 4096), "up": (11008, 4096), "down": (4096, 11008)}   # (N, K)
FORMATS = ("nf4+dq", "q4_k", "q8_0")
MS = (1, 16, 512, 4096)


def _gpu():
    """cupy if a CUDA GPU is usable here, else None."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
    except (ImportError, RuntimeError):  # no cupy, no driver, no device
        return None
    return cupy


def _event_time(cp, fn):
    """(GPU time between events around the call, host time the call took to return) in s."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3, host


def _turns(cp, calls, reps):
    """{name: (median s, best s, median host s)}: the calls take turns, rep after rep (after
    one warm-up). Host time is what the call cost before returning (launches are queued)."""
    for fn in calls.values():
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            times[name].append(_event_time(cp, fn))
    return {n: (float(np.median([g for g, _ in t])), float(min(g for g, _ in t)),
                float(np.median([h for _, h in t]))) for n, t in times.items()}


def _rel(cp, got, ref):
    return float(cp.abs(got - ref).max() / cp.abs(ref).max())


_REFS = ("deq_cublas", "dense")
_TF32 = ("packed", "deq_cublas")  # the sides timed again with TF32 on


def _with(module, name, value, call):
    """`call` with module.<name> set to value meanwhile."""
    def run():
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            return call()
        finally:
            setattr(module, name, saved)
    return run


def _small_m_sides(calls, m):
    """Add both small-M kernels, whichever `packed` picks, `packed` through Numba's launch, and
    above GEMV_MAX_M the candidate tiles."""
    for side, gemv_max in (("gemv", m), ("tile", 0)):  # GEMV_MAX_M 0: always the tile
        calls[side] = _with(cuda_ops, "GEMV_MAX_M", gemv_max, calls["packed"])
    calls["ordinary"] = _with(cuda_launch, "PREPARED_LAUNCHES", False, calls["packed"])
    calls["sum_after"] = _with(cuda_ops, "SUM_PARTS_IN_KERNEL", False, calls["packed"])
    if m > cuda_ops.GEMV_MAX_M:
        for side, tile in cuda_ops.SMALL_M_CANDIDATES.items():
            calls[side] = _with(cuda_ops, "SMALL_M_TILE", tile, calls["tile"])


def _tf32_pass(cp, dev, fwd, bwd, refs, reps):
    """(max rel err, fwd times, bwd times) of the _TF32 sides with TF32 tensor cores on for the
    whole pass (switching it per call would time the switch), named *_tf32."""
    dev.set_tf32(True)
    try:
        err = _max_err(cp, fwd, bwd, refs, _TF32)
        times = [_turns(cp, {s: calls[s] for s in _TF32}, reps) for calls in (fwd, bwd)]
    finally:
        dev.set_tf32(False)
    return (err, *({f"{s}_tf32": t for s, t in d.items()} for d in times))


def _max_err(cp, fwd, bwd, refs, sides):
    """Largest relative error of `sides` against the dense float32 products refs (fwd, bwd)."""
    return max([_rel(cp, fwd[s](), refs[0]) for s in sides if s in fwd]
               + [_rel(cp, bwd[s](), refs[1]) for s in sides if s in bwd])


def _ratios(name, t):
    """{key: value} of one direction's timings t = {side: (median, best, host median)}."""
    row = {f"{name}_{side}_ms": round(t[side][0] * 1e3, 4) for side in t}
    row.update({f"{name}_{side}_host_ms": round(t[side][2] * 1e3, 4) for side in t})
    row[f"{name}_vs_deq_cublas"] = round(t["packed"][0] / t["deq_cublas"][0], 3)
    for side in ("gemv", "gemv_rows2", "tile", "ordinary", "sum_after",
                 *cuda_ops.SMALL_M_CANDIDATES):
        if side in t:
            row[f"{name}_{side}_vs_deq_cublas"] = round(t[side][0] / t["deq_cublas"][0], 3)
    if "packed_tf32" in t:
        row[f"{name}_tf32_vs_deq_cublas_tf32"] = round(t["packed_tf32"][0]
                                                       / t["deq_cublas_tf32"][0], 3)
        row[f"{name}_tf32_speedup"] = round(t["packed"][0] / t["packed_tf32"][0], 3)
    row[f"{name}_vs_dense"] = round(t["packed"][0] / t["dense"][0], 3)
    return row


def bench(cp, dev, fmt, n, k, ms, reps, rng):
    w = random_packed(fmt, n, k, rng).to_device(dev)
    dense = cp.empty((n, k), cp.float32)
    dequantize_rows(w, 0, n, dense)                                    # (N, K)
    tf32 = int(cp.cuda.Device(dev.index).compute_capability) >= 80   # TF32 tensor cores

    def deq():
        full = cp.empty((n, k), cp.float32)
        return dequantize_rows(w, 0, n, full)
    rows = []
    for m in ms:
        x = cp.asarray(rng.standard_normal((m, k), dtype=np.float32))   # (M, K)
        dy = cp.asarray(rng.standard_normal((m, n), dtype=np.float32))  # (M, N)
        refs = (x @ dense.T, dy @ dense)                                # float32
        fwd = {"packed": lambda: linear_fwd(x, w, device=dev),
               "deq_cublas": lambda: x @ deq().T, "dense": lambda: x @ dense.T}
        bwd = {"packed": lambda: linear_bwd(dy, w, device=dev),
               "deq_cublas": lambda: dy @ deq(), "dense": lambda: dy @ dense}
        if m <= cuda_ops.FUSED_MAX_M:
            _small_m_sides(fwd, m)
            _small_m_sides(bwd, m)
        if m <= cuda_ops.GEMV_MAX_M:
            bwd["gemv_rows2"] = _with(cuda_gemv, "BWD_ROWS", 2, bwd["gemv"])
        row = {"M": m, "max_rel_err": _max_err(cp, fwd, bwd, refs,
                                                [s for s in bwd if s not in _REFS])}
        t_fwd, t_bwd = _turns(cp, fwd, reps), _turns(cp, bwd, reps)
        if m > cuda_ops.FUSED_MAX_M and tf32:
            row["max_rel_err_tf32"], tf_fwd, tf_bwd = _tf32_pass(cp, dev, fwd, bwd, refs, reps)
            t_fwd.update(tf_fwd)
            t_bwd.update(tf_bwd)
        rows.append({**row, **_ratios("fwd", t_fwd), **_ratios("bwd", t_bwd)})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--scratch-mib", type=int, default=None, help="device default if unset")
    args = p.parse_args(argv)
    cp = _gpu()
    if cp is None:
        print(json.dumps({"skipped": "no CUDA GPU (cupy and a device are needed)"}))
        return 0
    dev = Device.cuda(0)
    dev.set_tf32(False)  # float32 unless a side says otherwise, whatever CUPY_TF32 says
    if args.scratch_mib:
        dev.set_scratch_cap(args.scratch_mib << 20)
    rng = np.random.default_rng(0)
    ms = [int(v) for v in args.ms.split(",")]
    results = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        for fmt in args.formats.split(","):
            for row in bench(cp, dev, fmt, n, k, ms, args.reps, rng):
                results.append({"shape": shape, "N": n, "K": k, "format": fmt, **row})
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    props = cp.cuda.runtime.getDeviceProperties(0)
    print(json.dumps({"device": props["name"].decode(), "scratch_mib": dev.scratch_cap >> 20,
                      "precision": "float32 (cuBLAS); *_tf32 sides: TF32 tensor cores",
                      "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
