"""CUDA packed linear (fused dequant-GEMM) vs cupy dense float32 matmul, per layer shape (JSON)."""
import argparse
import json
import sys

import numpy as np

# (name, N = out_features, K = in_features)
SHAPES = {
    "smollm2-135m": [("q_o", 576, 576), ("k_v", 192, 576), ("gate_up", 1536, 576),
                     ("down", 576, 1536)],
    "llama-2-7b": [("qkvo", 4096, 4096), ("gate_up", 11008, 4096), ("down", 4096, 11008)],
}
BATCHES = (1, 8, 64, 512, 2048)
FORMATS = ("nf4", "nf4_dq", "fp4", "int8", "q4_0", "q4_1", "q8_0")


def _gpu():
    """cupy if a CUDA GPU is usable here, else None."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
    except (ImportError, RuntimeError):  # no cupy, no driver, no device
        return None
    from numba import config
    return None if config.ENABLE_CUDASIM else cupy


def _time(cp, fn, reps):
    """Median seconds of fn() over reps runs, timed with CUDA events."""
    fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(reps):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def _weight(cp, fmt, n, k, rng):
    from packlora import Device
    from packlora.quant import quantize
    base, _, dq = fmt.partition("_")
    w = quantize(rng.standard_normal((n, k)).astype(np.float32), base,
                 double_quant=bool(dq))
    return w.to_device(Device.cuda(0)), cp.asarray(w.dequantize())   # packed, dense (N, K)


def _timings(cp, ops, w, dense, x, dy, y, dx, reps):
    """Seconds of packed and dense fwd / bwd for one batch."""
    return {"fwd_packed": _time(cp, lambda: ops.linear_fwd(x, w, out=y), reps),
            "fwd_dense": _time(cp, lambda: x @ dense.T, reps),
            "bwd_packed": _time(cp, lambda: ops.linear_bwd(dy, w, out=dx), reps),
            "bwd_dense": _time(cp, lambda: dy @ dense, reps)}


def _bench_shape(cp, fmt, n, k, batches, reps, rng):
    from packlora.kernels.cuda import ops
    w, dense = _weight(cp, fmt, n, k, rng)
    rows = []
    for m in batches:
        x = cp.asarray(rng.standard_normal((m, k)).astype(np.float32))       # (M, K)
        dy = cp.asarray(rng.standard_normal((m, n)).astype(np.float32))      # (M, N)
        y, dx = ops.linear_fwd(x, w), ops.linear_bwd(dy, w)
        err = max(float(cp.abs(y - x @ dense.T).max() / cp.abs(x @ dense.T).max()),
                  float(cp.abs(dx - dy @ dense).max() / cp.abs(dy @ dense).max()))
        t = _timings(cp, ops, w, dense, x, dy, y, dx, reps)
        rows.append({"M": m, **{f"{key}_ms": v * 1e3 for key, v in t.items()},
                     "fwd_ratio": t["fwd_packed"] / t["fwd_dense"],
                     "bwd_ratio": t["bwd_packed"] / t["bwd_dense"],
                     "max_rel_err": err,
                     "packed_bytes": w.nbytes, "dense_bytes": int(dense.nbytes)})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--formats", default="nf4,q4_1,q8_0", help=f"comma list of {FORMATS}")
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    cp = _gpu()
    if cp is None:
        print(json.dumps({"skipped": "no CUDA GPU"}))
        return 0
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    for model in args.models.split(","):
        for layer, n, k in SHAPES[model]:
            for fmt in args.formats.split(","):
                for row in _bench_shape(cp, fmt, n, k, batches, args.reps, rng):
                    results.append({"model": model, "layer": layer, "N": n, "K": k,
                                    "format": fmt, **row})
    print(json.dumps({"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                      "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
