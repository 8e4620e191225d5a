"""The same SmolLM2 fine-tune as one process with every core's threads and as `mpiexec -n R`
ranks of cores / R threads each, same global batch, taking turns; tokens/s of each as JSON.

On one machine this shows what the ranks cost (duplicated model, a gradient Allreduce per step,
smaller matrices per rank), not a speed-up: that needs more machines (bench/mpi_scaling.py).
The first steps (compilation, warm-up) are left out of the mean.

usage: python bench/mpi_vs_threads.py [--config configs/smollm2-demo.yaml] [--steps 8]
       [--turns 2] [--ranks 2]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hostinfo import cpu_name  # bench/hostinfo.py

ROOT = Path(__file__).resolve().parent.parent
SKIP = 2  # first steps left out (compilation, page faults of the first batches)


def _run(cmd, out, env):
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "tokens_per_s" in r][SKIP:]
    return (sum(r["tokens"] for r in steps) / sum(r["step_time_s"] for r in steps),
            statistics.mean(r["loss"] for r in steps))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="configs/smollm2-demo.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args(argv)
    bindir = Path(sys.executable).parent
    packlora, mpiexec = str(bindir / "packlora"), shutil.which("mpiexec", path=str(bindir))
    if mpiexec is None:
        print(json.dumps({"skipped": "no mpiexec next to python: pip install 'packlora[mpi]'"}))
        return 0
    over = [f"train.max_steps={args.steps}", "train.eval_every=0", "train.save_every=0",
            "overwrite=true"]
    cores = os.cpu_count()
    sides = {f"1 process x {cores} threads": ([packlora], cores),
             f"{args.ranks} ranks x {cores // args.ranks} threads": (
                 [mpiexec, "-n", str(args.ranks), packlora], cores // args.ranks)}
    got = {name: [] for name in sides}
    with tempfile.TemporaryDirectory(prefix="packlora-mpi-") as tmp:
        for turn in range(args.turns):
            for i, (name, (launcher, threads)) in enumerate(sides.items()):
                out = Path(tmp) / f"run{i}"
                env = dict(os.environ, PACKLORA_THREADS=str(threads))
                cmd = [*launcher, "finetune", args.config, *over, f"output_dir={out}"]
                got[name].append(_run(cmd, out, env))
    result = {"cpu": cpu_name(), "cores": cores,
              "config": args.config, "steps": args.steps, "steps_left_out": SKIP}
    for name, runs in got.items():
        result[name] = {"tokens_per_s": [round(t, 1) for t, _ in runs],
                        "mean_loss": [round(loss, 5) for _, loss in runs]}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
