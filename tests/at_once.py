"""Commands run at once, one a core: the simulator's and the CUDA compiler's tests spend minutes
in one process on one core, while the other cores of the machine wait."""
import os
import subprocess
import time


def workers():
    """How many processes to run at once: one a core this process may use, up to 4."""
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")  # Linux
             else os.cpu_count())
    return max(1, min(4, cores or 1))


def run_at_once(commands, timeout, **popen):
    """The standard output of each command (a list of arguments), all started together and all
    within `timeout` seconds; fails with a command's standard error if it fails. `popen`:
    further arguments of subprocess.Popen (env, cwd)."""
    deadline = time.monotonic() + timeout
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              **popen) for cmd in commands]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            assert proc.returncode == 0, err[-4000:]
            outs.append(out)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return outs
