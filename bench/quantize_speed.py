"""Quantizing float weights to the K-quants and IQ4_NL / IQ4_XS, in turns: packlora's compiled
searches (packlora.kernels.quantize, what load, merge --quantize and `packlora quantize` run),
its numpy reference (packlora.quant.quantize) and llama.cpp's C quantizer (ggml_quantize_chunk
from the libggml that llama-cpp-python ships, on as many threads as Numba has, rows split between
them as llama-quantize splits them). ns per value, medians over the turns, the bytes' agreement
with llama.cpp's, one JSON document.

Usage: python bench/quantize_speed.py [--turns 3] [--rows 1024] [--cols 4096]
                                      [--formats q4_k,iq4_xs,...]
"""
import argparse
import ctypes
import importlib.util
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import packlora  # noqa: F401  (first: thread settings before numpy loads OpenBLAS)
import gguf
import numpy as np
from numba import get_num_threads
from packlora import kernels
from packlora.quant import quantize as reference

from hostinfo import cpu_name  # bench/hostinfo.py


class LlamaCppQuantizer:
    """ggml_quantize_chunk over row ranges on `threads` threads (ctypes lets go of the GIL)."""

    def __init__(self, threads):
        spec = importlib.util.find_spec("llama_cpp")
        found = sorted(Path(spec.submodule_search_locations[0]).rglob("libggml-base.so*")) \
            if spec else []
        if not found:
            raise SystemExit("quantize_speed: llama-cpp-python with its libggml-base is needed "
                             "(scripts/test.sh builds one into the test environment)")
        self.fn = ctypes.CDLL(str(found[0])).ggml_quantize_chunk
        self.fn.restype = ctypes.c_size_t
        self.fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self.pool = ThreadPoolExecutor(threads)
        self.threads = threads

    def __call__(self, x, qtype):
        elems, nbytes = gguf.constants.GGML_QUANT_SIZES[qtype]
        n, k = x.shape
        out = np.empty((n, k // elems * nbytes), np.uint8)
        step = -(-n // self.threads)

        def part(r0):
            rows = min(step, n - r0)     # the start is counted in values, not rows
            self.fn(int(qtype), x.ctypes.data, out.ctypes.data, r0 * k, rows, k, None)
        list(self.pool.map(part, range(0, n, step)))
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--formats", default="q2_k,q3_k,q4_k,q5_k,q6_k,iq4_nl,iq4_xs")
    a = ap.parse_args()
    x = (np.random.default_rng(0).standard_normal((a.rows, a.cols)) * 0.02).astype(np.float32)
    llama = LlamaCppQuantizer(get_num_threads())
    sides = {"compiled": lambda f: kernels.quantize(x, f).buffers["blocks"],
             "numpy_reference": lambda f: reference(x, f).buffers["blocks"],
             "llama_cpp": lambda f: llama(x, gguf.GGMLQuantizationType[f.upper()])}
    results = {}
    for fmt in a.formats.split(","):
        kernels.quantize(x[:8], fmt)                     # compile before timing
        times = {side: [] for side in sides}
        for _ in range(a.turns):
            for side, run in sides.items():
                t0 = time.perf_counter()
                blocks = run(fmt)
                times[side].append(time.perf_counter() - t0)
                if side == "compiled":
                    ours = blocks
        ns = {side: statistics.median(t) / x.size * 1e9 for side, t in times.items()}
        results[fmt] = {**{f"{side}_ns_per_value": round(v, 2) for side, v in ns.items()},
                        "compiled_vs_numpy": round(ns["numpy_reference"] / ns["compiled"], 2),
                        "compiled_vs_llama_cpp": round(ns["compiled"] / ns["llama_cpp"], 2),
                        "bytes_equal_to_llama_cpp": round(float(
                            (ours == sides["llama_cpp"](fmt)).mean()), 5)}
    print(json.dumps({"cpu": cpu_name(), "threads": get_num_threads(), "shape": x.shape,
                      "turns": a.turns, "formats": results}, indent=1))


if __name__ == "__main__":
    main()
