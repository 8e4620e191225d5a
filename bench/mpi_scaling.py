"""On paper: how a data-parallel fine-tune scales with ranks, from a measured one-process step
time and the size of the gradient allreduce (the adapter's parameters, from the memory plan).

A step on N ranks takes T1 / N (each rank does 1/N of the global batch) plus one ring
allreduce of the flat float32 gradient buffer: 2 (N - 1) / N * bytes / bandwidth, plus
2 (N - 1) message latencies. Prints JSON: per config and link speed, step time, speed-up and
efficiency at each rank count, and the rank count past which more machines stop paying off
(efficiency below 50%).

usage: python bench/mpi_scaling.py [--config configs/smollm2-demo.yaml --step-s 5.5] ...
"""
import argparse
import json
import sys
from pathlib import Path

import packlora as pl

LINKS = {"1 Gb/s": (1e9 / 8, 50e-6), "10 Gb/s": (10e9 / 8, 10e-6),
         "100 Gb/s": (100e9 / 8, 3e-6)}  # bytes/s, latency per message
RANKS = (1, 2, 4, 8, 16, 32, 64, 128)
ROOT = Path(__file__).resolve().parent.parent
# (config, overrides, one-process seconds per step on this project's 2-core machines, from the
# measured 5.5 s per 4 x 256-token SmolLM2 step and 112 s per 1 x 512 7B step)
CASES = [(str(ROOT / "configs/smollm2-demo.yaml"),
          ("train.batch_size=64", "data.max_seq_len=256"), 5.5 * 64 / 4),
         (str(ROOT / "configs/llama2-7b-qlora.yaml"),
          (f"model={ROOT / 'configs/models/llama-2-7b'}", "train.grad_accum=1", "lora.dropout=0.0",
           "train.batch_size=128"), 112.0 * 128)]


def allreduce_s(nbytes, ranks, link):
    bandwidth, latency = LINKS[link]
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency


def scaling(config, overrides, step_s):
    rep = pl.memory.plan(config, overrides)
    nbytes = rep["plan"]["categories"]["adapters"]  # = the flat gradient buffer
    out = {"config": config, "overrides": list(overrides), "one_process_step_s": step_s,
           "global_batch": rep["run"]["batch_size"], "allreduce_bytes": nbytes, "links": {}}
    for link in LINKS:
        rows, stop = [], None
        for n in RANKS:
            if rep["run"]["batch_size"] % n:
                continue
            t = step_s / n + allreduce_s(nbytes, n, link)
            eff = step_s / (n * t)
            rows.append({"ranks": n, "step_s": round(t, 4), "speedup": round(step_s / t, 2),
                         "efficiency": round(eff, 3)})
            if stop is None and eff < 0.5:
                stop = n
        out["links"][link] = {"rows": rows, "efficiency_below_50pct_at_ranks": stop}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config")
    ap.add_argument("--step-s", type=float, help="measured one-process seconds per step")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    cases = [(a.config, tuple(a.overrides), a.step_s)] if a.config else CASES
    json.dump([scaling(*c) for c in cases], sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
