"""Run a test file's simulator cases in a subprocess with Numba's CUDA simulator on (numba.cuda
reads the flag at import, so the pytest process itself cannot switch to it)."""
import json
import os
import subprocess
import sys


def simulator_results(script, timeout):
    """The JSON that `python script` prints last, run with NUMBA_ENABLE_CUDASIM=1."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, str(script)], check=False, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
