"""Packed-weight matmul time ÷ dense float32 BLAS time, and extra memory, as one JSON document.

Packed and dense calls take turns and each side's best time counts (the machines are shared);
with --rounds N the whole sweep runs N times and the best over all of them counts.

Usage: python bench/kernels.py [--quick] [--formats nf4,q4_0] [--ms 1,8,512] [--rounds 2]
                               [--shapes llama.attn,llama.up]
"""
import argparse
import json
import os
import statistics
import time
import tracemalloc

import packlora  # noqa: F401, I001  (first: thread settings before numpy loads OpenBLAS)
import numpy as np
from numba import get_num_threads
from packlora import Device
from packlora.kernels import linear_bwd, linear_fwd
from packlora.kernels.cpu import ops as cpu_ops
from packlora.quant import DYNAMIC_MAP, REGISTRY, PackedWeight, quantize

from hostinfo import cpu_name  # bench/hostinfo.py

SHAPES = {  # name -> (N, K)
    "smol.q_o": (576, 576), "smol.kv": (192, 576), "smol.up": (1536, 576),
    "smol.down": (576, 1536), "llama.attn": (4096, 4096), "llama.up": (11008, 4096),
    "llama.down": (4096, 11008),
}
QUICK_SHAPES = ("smol.q_o", "smol.up", "llama.attn", "llama.up")
FORMATS = ("nf4", "nf4+dq", *(n for n in REGISTRY if n != "nf4"))  # every registry format
QUICK_FORMATS = ("nf4", "nf4+dq", "int8", "q4_0", "q8_0", "q4_k", "q6_k")
MS = (1, 8, 64, 512, 2048)
GGML_LAYOUT = {n: f.layout for n, f in REGISTRY.items() if f.gguf_type is not None}


def random_packed(fmt, N, K, rng):
    """A packed weight with random codes (timing does not depend on the values)."""
    dq = fmt.endswith("+dq")
    fmt = fmt.removesuffix("+dq")
    numel = N * K
    if REGISTRY[fmt].float16:  # random bytes would be NaNs and subnormals: real values
        return quantize(rng.standard_normal((N, K), dtype=np.float32), fmt)
    if fmt in GGML_LAYOUT:
        lay = GGML_LAYOUT[fmt]
        blocks = rng.integers(0, 256, (N, K // lay.elems, lay.nbytes), dtype=np.uint8)
        scale = np.array([0.01, -0.5], np.float16).view(np.uint8)
        blocks[:, :, lay.scale_at:lay.scale_at + 2] = scale[0:2]
        if lay.min_at is not None:
            blocks[:, :, lay.min_at:lay.min_at + 2] = scale[2:4]
        return PackedWeight(fmt, (N, K), {"blocks": blocks.reshape(N, -1)}, lay.elems, False)
    nb = -(-numel // 64)
    if fmt == "int8":
        codes = rng.integers(-127, 128, numel, dtype=np.int8)
    else:
        codes = rng.integers(0, 256, -(-numel // 2), dtype=np.uint8)
    bufs = {"codes": codes}
    if dq:
        bufs.update(absmax_q=rng.integers(0, 256, nb, dtype=np.uint8),
                    absmax_code=np.asarray(DYNAMIC_MAP, np.float32),
                    absmax_scale=rng.random(-(-nb // 256), dtype=np.float32),
                    absmax_offset=np.ones(1, np.float32))
    else:
        bufs["absmax"] = rng.random(nb, dtype=np.float32) + 0.5
    return PackedWeight(fmt, (N, K), bufs, 64, dq)


def paired_times(packed, dense, budget_s=0.6, min_reps=5, max_reps=40):
    """(packed, dense) best times, the two taking turns: on a shared machine a slow moment then
    hits both sides instead of one, and the best of several runs is the least disturbed."""
    packed(), dense()  # warm-up (compilation, page faults of the output)
    tp, td = [], []
    start = time.perf_counter()
    while len(tp) < min_reps or (len(tp) < max_reps and time.perf_counter() - start < budget_s):
        for fn, times in ((dense, td), (packed, tp)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(tp), min(td)


def peak_extra(fn, out_bytes):
    """tracemalloc peak during one call (output allocated inside) minus the output."""
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return max(0, peak - out_bytes)


COLD_BYTES = 64 << 20  # twice the last-level cache of the machines this ran on


def _copies(w, n):
    return [PackedWeight(w.format, w.shape, {k: v.copy() for k, v in w.buffers.items()},
                         w.block_size, w.double_quant) for _ in range(n)]


def cold_times(x, dy, Wd, w):
    """((packed, dense) fwd, (packed, dense) bwd) seconds per weight with the weights streamed
    from memory, as in a model's decode step: each side cycles through enough copies of its
    weight to fill COLD_BYTES, so no copy is still cached when it is used again. (None, None)
    when one weight alone already fills it."""
    dense_n = -(-COLD_BYTES // Wd.nbytes)
    if dense_n == 1:
        return None, None
    dense = [Wd.copy() for _ in range(dense_n)]
    packed = _copies(w, -(-COLD_BYTES // w.nbytes))
    y = np.empty((x.shape[0], Wd.shape[0]), np.float32)
    dx = np.empty((dy.shape[0], Wd.shape[1]), np.float32)

    def sweep(items, call):
        def run():
            for item in items:
                call(item)
        return run

    out = []
    for pcall, dcall in ((lambda p: linear_fwd(x, p, out=y), lambda d: np.matmul(x, d.T, out=y)),
                         (lambda p: linear_bwd(dy, p, out=dx), lambda d: np.matmul(dy, d, out=dx))):
        tp, td = paired_times(sweep(packed, pcall), sweep(dense, dcall), budget_s=1.0)
        out.append((tp / len(packed), td / len(dense)))
    return tuple(out)


def bench_shape(name, N, K, ms, formats, dev, rng):
    """Rows of raw best times (seconds, packed then dense) and peak extra bytes."""
    Wd = rng.standard_normal((N, K), dtype=np.float32)
    # ggml blocks never cross a row: K-quants (256) skip shapes such as SmolLM2's K = 576
    weights = {f: random_packed(f, N, K, rng) for f in formats
               if K % GGML_LAYOUT.get(f.removesuffix("+dq"), GGML_LAYOUT["q4_0"]).elems == 0}
    rows = []
    for M in ms:
        x = rng.standard_normal((M, K), dtype=np.float32)
        dy = rng.standard_normal((M, N), dtype=np.float32)
        y = np.empty((M, N), np.float32)
        dx = np.empty((M, K), np.float32)
        for f, w in weights.items():
            fwd = paired_times(lambda: linear_fwd(x, w, device=dev, out=y),
                               lambda: np.matmul(x, Wd.T, out=y))
            bwd = paired_times(lambda: linear_bwd(dy, w, device=dev, out=dx),
                               lambda: np.matmul(dy, Wd, out=dx))
            cold = cold_times(x, dy, Wd, w) if M <= 8 else (None, None)
            rows.append({
                "shape": name, "N": N, "K": K, "M": M, "format": f,
                "times": {"fwd": fwd, "bwd": bwd, "fwd_cold": cold[0], "bwd_cold": cold[1]},
                "fwd_peak_extra_bytes": peak_extra(lambda: linear_fwd(x, w, device=dev), M * N * 4),
                "bwd_peak_extra_bytes": peak_extra(lambda: linear_bwd(dy, w, device=dev),
                                                   M * K * 4),
            })
    return rows


def merge_rounds(rounds):
    """One row per entry from several sweeps: each side's best time, the largest peak."""
    rows = []
    for entries in zip(*rounds):
        row = dict(entries[0])
        row["times"] = {k: None if v is None else tuple(min(e["times"][k][i] for e in entries)
                                                        for i in (0, 1))
                        for k, v in row["times"].items()}
        for k in ("fwd_peak_extra_bytes", "bwd_peak_extra_bytes"):
            row[k] = max(e[k] for e in entries)
        rows.append(row)
    return rows


def finish(row):
    """Ratios (packed ÷ dense) and the dense times in ms, from a row's raw times."""
    t = row.pop("times")
    ratio = {k: None if v is None else round(v[0] / v[1], 3) for k, v in t.items()}
    return {
        **{k: row[k] for k in ("shape", "N", "K", "M", "format")},
        "fwd_path": "fused" if row["M"] <= cpu_ops.FUSED_MAX_M else "tiled",
        "bwd_path": "fused" if row["M"] <= cpu_ops.FUSED_MAX_M_BWD else "tiled",
        "fwd_ratio": ratio["fwd"], "bwd_ratio": ratio["bwd"],
        "fwd_ratio_cold": ratio["fwd_cold"], "bwd_ratio_cold": ratio["bwd_cold"],
        "dense_fwd_ms": round(t["fwd"][1] * 1e3, 3), "dense_bwd_ms": round(t["bwd"][1] * 1e3, 3),
        "fwd_peak_extra_bytes": row["fwd_peak_extra_bytes"],
        "bwd_peak_extra_bytes": row["bwd_peak_extra_bytes"],
    }


def targets(rows):
    """Which rows meet ≤ 1.15× dense at M ≥ 256 and ≤ 1.0× dense at M ≤ 8."""
    out = {}
    checks = (("M>=256 <=1.15x", lambda r: r["M"] >= 256, 1.15, ""),
              ("M<=8 <=1.0x", lambda r: r["M"] <= 8, 1.0, ""),
              ("M<=8 <=1.0x weights from memory", lambda r: r["M"] <= 8, 1.0, "_cold"))
    for label, pick, limit, kind in checks:
        sel = [r for r in rows if pick(r)]
        ratios = [r[f"{side}_ratio{kind}"] if r.get(f"{side}_ratio{kind}") is not None
                  else r[f"{side}_ratio"] for r in sel for side in ("fwd", "bwd")]
        out[label] = {
            "met": sum(v <= limit for v in ratios), "of": len(ratios),
            "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
            "worst": max(ratios) if ratios else None,
        }
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a small subset (no M=2048 Llama shapes)")
    ap.add_argument("--formats", default=None,
                    help="comma-separated subset of " + ",".join(FORMATS))
    ap.add_argument("--ms", default=None, help="comma-separated batch sizes")
    ap.add_argument("--rounds", type=int, default=1,
                    help="sweeps over all entries; each side's best time over them counts (a "
                         "slow stretch of a shared machine then has to hit every sweep)")
    ap.add_argument("--scratch-mib", type=int, default=None,
                    help="the device's dense scratch cap (default: the device's default)")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of " + ",".join(SHAPES))
    args = ap.parse_args(argv)
    default = QUICK_FORMATS if args.quick else FORMATS
    formats = args.formats.split(",") if args.formats else default
    ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else MS
    names = QUICK_SHAPES if args.quick else tuple(SHAPES)
    names = args.shapes.split(",") if args.shapes else names
    dev = Device.cpu()
    if args.scratch_mib:
        dev.set_scratch_cap(args.scratch_mib << 20)
    rng = np.random.default_rng(0)
    rounds = []
    for _ in range(args.rounds):
        sweep = []
        for name in names:
            N, K = SHAPES[name]
            skip_big = args.quick and name.startswith("llama")
            shape_ms = [m for m in ms if not (skip_big and m >= 2048)]
            sweep += bench_shape(name, N, K, shape_ms, formats, dev, rng)
        rounds.append(sweep)
    rows = [finish(r) for r in merge_rounds(rounds)]
    doc = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                    "numba_threads": get_num_threads(),
                    "fused_max_m": [cpu_ops.FUSED_MAX_M, cpu_ops.FUSED_MAX_M_BWD],
                    "scratch_cap_bytes": dev.scratch_cap, "rounds": args.rounds},
        "results": rows,
        "targets": targets(rows),
    }
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
