"""bench/gpu_check.sh, the one call a GPU machine gets, run here with stand-ins for python3 and
nvidia-smi: what it leaves in its output folder is what that call brings back, at most 8 files
(the device machine returns no more), at its end and while any stage runs."""
import json
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"
MAX_FILES = 8   # files a device call brings back from its output folder
STAGES = ("tests", "kernels", "rng", "smollm2", "llama7b", "profile")
# A stage's stand-in prints, as JSON, its arguments and how many files its output folder holds
# while it runs; on standard error, a line naming it.
FAKE_PYTHON = """#!/bin/sh
echo "{\\"args\\": \\"$*\\", \\"files\\": $(ls "$GPU_CHECK_OUT" | wc -l)}"
echo "stand-in stderr: $*" >&2
"""


def _fake_bin(folder):
    folder.mkdir()
    for name, text in (("python3", FAKE_PYTHON), ("nvidia-smi", "#!/bin/sh\necho 'NVIDIA H200'\n")):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def test_gpu_check_leaves_what_one_device_call_brings_back(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{_fake_bin(tmp_path / 'bin')}:{os.environ['PATH']}",
           "GPU_CHECK_OUT": str(out), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    done = subprocess.run(["bash", str(SCRIPT), str(out), str(tmp_path / "no-wheels")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= MAX_FILES, files
    stages = [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]
    assert [s["stage"] for s in stages] == list(STAGES)
    assert all(s["rc"] == 0 for s in stages)
    logs = (out / "logs.txt").read_text()
    assert logs.startswith("== gpu\nNVIDIA H200\n")
    for name in STAGES:
        assert f"== {name}\nstand-in stderr:" in logs
    outputs = [out / f for f in files if f not in ("logs.txt", "stages.jsonl")]
    assert len(outputs) == len(STAGES)
    for path in outputs:  # each stage's standard output whole in its own file
        seen = json.loads(path.read_text())
        assert seen["files"] <= MAX_FILES, (path.name, seen)
    assert "bench/kernels_cuda.py" in (out / "kernels_cuda.json").read_text()
