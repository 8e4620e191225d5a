"""packlora's row kernels (SwiGLU, RMSNorm, attention's softmax rows, cross-entropy rows) against
the numpy expressions they replace, on both sides of SERIAL_MAX (a short sequence's rows run on
the calling thread, a batch's in parallel), as one JSON document.

Kernel and numpy calls take turns and each side's best time counts (the machines are shared).

Usage: python bench/row_kernels.py [--turns 30]
"""
import argparse
import json
import time

import packlora  # noqa: F401, I001  (first: thread settings before numpy loads OpenBLAS)
import numpy as np
from hostinfo import cpu_name
from numba import get_num_threads
from packlora.kernels.cpu import SERIAL_MAX
from packlora.kernels.cpu import attention as att
from packlora.kernels.cpu import elementwise as ew
from packlora.kernels.cpu.softmax_ce import ce_rows

HIDDEN, FFN, VOCAB, HEADS = 576, 1536, 49152, 9  # SmolLM2-135M


def cases(tokens, rng):
    """{name: (kernel call, numpy call)} for `tokens` rows of SmolLM2's shapes."""
    x = rng.standard_normal((tokens, FFN)).astype(np.float32)
    u, y = x[::-1].copy(), np.empty_like(x)
    h, w = x[:, :HIDDEN].copy(), np.ones(HIDDEN, np.float32)
    hy, r = np.empty_like(h), np.empty(tokens, np.float32)
    s0 = rng.standard_normal((HEADS * tokens, tokens)).astype(np.float32)
    s, lse = np.empty_like(s0), np.empty(len(s0), np.float32)
    z = rng.standard_normal((max(1, tokens // 16), VOCAB)).astype(np.float32)
    tgt = rng.integers(0, VOCAB, len(z)).astype(np.int64)
    zl, nll = np.empty(len(z), np.float32), np.empty(len(z), np.float32)

    def softmax_np():
        m = s0.max(axis=1, keepdims=True)
        e = np.exp(s0 - m)
        return e / e.sum(axis=1, keepdims=True)

    def ce_np():
        m = z.max(axis=1, keepdims=True)
        return np.log(np.exp(z - m).sum(axis=1)) + m[:, 0] - z[np.arange(len(z)), tgt]

    def softmax_pl():
        np.copyto(s, s0)
        att.softmax_rows(s, lse, np.float32(1.0), att.NO_CAUSAL)

    return {
        "swiglu_fwd": (lambda: ew.swiglu_fwd(x, u, y), lambda: x / (1 + np.exp(-x)) * u),
        "rmsnorm_fwd": (lambda: ew.rmsnorm_fwd(h, w, np.float32(1e-5), hy, r),
                        lambda: h / np.sqrt((h * h).mean(axis=1, keepdims=True) + 1e-5) * w),
        "softmax_rows": (softmax_pl, softmax_np),
        "ce_rows": (lambda: ce_rows(z, tgt, -100, zl, nll), ce_np),
    }


def best_in_turns(pair, turns):
    """Best seconds of each of (kernel, numpy), called in turns."""
    best = [float("inf"), float("inf")]
    for fn in pair:
        fn()  # compile, warm the caches
    for _ in range(turns):
        for i, fn in enumerate(pair):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for tokens in (16, 64, 256):
        for name, pair in cases(tokens, rng).items():
            kernel_s, numpy_s = best_in_turns(pair, args.turns)
            rows.append({"kernel": name, "tokens": tokens, "kernel_us": round(kernel_s * 1e6, 1),
                         "numpy_us": round(numpy_s * 1e6, 1),
                         "numpy_over_kernel": round(numpy_s / kernel_s, 2)})
    print(json.dumps({"bench": "row_kernels", "cpu": cpu_name(), "threads": get_num_threads(),
                      "serial_max": SERIAL_MAX, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
