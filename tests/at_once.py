"""Commands run at once, one a core: the simulator's and the CUDA compiler's tests spend minutes
in one process on one core, while the other cores of the machine wait."""
import contextlib
import os
import subprocess
import tempfile
import time


def workers():
    """How many processes to run at once: one a core this process may use, up to 4."""
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")  # Linux
             else os.cpu_count())
    return max(1, min(4, cores or 1))


def run_at_once(commands, timeout, **popen):
    """The standard output of each command (a list of arguments), all started together and all
    within `timeout` seconds; fails with a command's standard error if it fails. `popen`:
    further arguments of subprocess.Popen (env, cwd). The output goes to files, not pipes: a
    command that writes more than a pipe holds must not wait for its turn to be read."""
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as files:
        logs = [(files.enter_context(tempfile.TemporaryFile("w+")),
                 files.enter_context(tempfile.TemporaryFile("w+"))) for _ in commands]
        procs = [subprocess.Popen(cmd, stdout=out, stderr=err, **popen)
                 for cmd, (out, err) in zip(commands, logs)]
        try:
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        for proc, (out, err) in zip(procs, logs):
            out.seek(0)
            err.seek(0)
            assert proc.returncode == 0, err.read()[-4000:]
        return [out.read() for out, _ in logs]
