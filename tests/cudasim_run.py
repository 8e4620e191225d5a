"""Run a test file's simulator cases in subprocesses with Numba's CUDA simulator on (numba.cuda
reads the flag at import, so the pytest process itself cannot switch to it). The simulator runs
Python for every GPU thread, on one core: several processes at once can share a file's jobs,
each job run by whichever process claims it first."""
import json
import os
import sys
import tempfile

import numpy as np
from at_once import run_at_once


def simulator_results(script, timeout, processes=1):
    """The JSON objects that `python script CLAIMS` prints last, merged, from `processes` runs at
    once with NUMBA_ENABLE_CUDASIM=1, all within `timeout` seconds. CLAIMS is a folder the runs
    share (run_claimed); a script that does not share out its jobs ignores it."""
    # one BLAS thread: the simulator's products are tiny, and idle BLAS threads spinning in
    # each process would take the cores the other processes run on
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", OPENBLAS_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as claims:
        outs = run_at_once([[sys.executable, str(script), claims]] * processes, timeout, env=env)
    merged = {}
    for out in outs:
        merged.update(json.loads(out.strip().splitlines()[-1]))
    return merged


def run_claimed(jobs, claims):
    """{key: job(rng)} for each job of `jobs` ({key: function of a numpy Generator}) that this
    process claims first: a claim is a file named by the job's place in `jobs`, made in the
    folder `claims` only if no other process made it. A job's generator is seeded with its
    place, so its data do not depend on which process ran it."""
    out = {}
    for i, (key, job) in enumerate(jobs.items()):
        try:
            os.close(os.open(os.path.join(claims, str(i)), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        out[key] = job(np.random.default_rng(i))
    return out
