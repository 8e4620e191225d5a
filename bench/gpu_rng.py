"""Dropout masks on a GPU: one draw of packlora's CountingRng (a fresh Philox generator per draw,
src/rng.py) against the same scheme on cupy's default generator (XORWOW, what it drew from
before), taking turns; JSON of milliseconds per draw, the generator's set-up included.

Shapes: the LoRA inputs of configs/llama2-7b-qlora.yaml (batch 1 x 512 tokens, rows of 4096 and
of 11008), each drawn as LoraMatmul draws its mask (uniform float32, `random`).

Usage: python bench/gpu_rng.py [--rounds 5] [--reps 20]
"""
import argparse
import json
import sys
import time

import packlora  # noqa: F401, I001  (first: thread settings before numpy loads OpenBLAS)
import numpy as np
from packlora.rng import CountingRng

SHAPES = ((512, 4096), (512, 11008))


class _XorwowRng(CountingRng):
    """CountingRng on cupy's default bit generator (XORWOW): the former scheme."""

    def __init__(self, xp, seed):
        super().__init__(xp, seed)
        self._bits = xp.random.XORWOW


def _ms_per_draw(cupy, rng, shape, reps):
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        rng.random(shape, dtype=np.float32)
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no cupy, or no driver / GPU
        print(f"gpu_rng.py: needs a GPU with cupy ({e})", file=sys.stderr)
        return 2
    sides = {"philox": CountingRng(cupy, 0), "xorwow": _XorwowRng(cupy, 0)}
    rows = []
    for shape in SHAPES:
        for rng in sides.values():  # warm-up: each generator's kernels compiled once
            _ms_per_draw(cupy, rng, shape, 2)
        times = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, rng in sides.items():
                times[name].append(_ms_per_draw(cupy, rng, shape, args.reps))
        med = {name: float(np.median(t)) for name, t in times.items()}
        rows.append({"shape": list(shape), "philox_ms": round(med["philox"], 4),
                     "xorwow_ms": round(med["xorwow"], 4),
                     "philox_vs_xorwow": round(med["philox"] / med["xorwow"], 3)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"per_draw": rows, "draws_per_7b_step": "224, 448 with checkpointing"},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
