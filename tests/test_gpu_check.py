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


def _run(tmp_path, wheels, **env):
    """(output folder, finished process) of gpu_check.sh with the stand-ins, in tmp_path."""
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{_fake_bin(tmp_path / 'bin')}:{os.environ['PATH']}",
           "GPU_CHECK_OUT": str(out), "NUMBA_CACHE_DIR": str(tmp_path / "numba"), **env}
    return out, subprocess.run(["bash", str(SCRIPT), str(out), str(wheels)], env=env,
                               capture_output=True, text=True, timeout=60)


def test_gpu_check_leaves_what_one_device_call_brings_back(tmp_path):
    out, done = _run(tmp_path, tmp_path / "no-wheels")
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


def _run_with_wheels(tmp_path, stamp):
    """gpu_check.sh with a wheel folder stamped `stamp` (None: no stamp), stand-ins as above."""
    wheels = tmp_path / "wheels"
    wheels.mkdir(parents=True)
    (wheels / "packlora-0.1.0-py3-none-any.whl").write_bytes(b"stand-in")
    if stamp is not None:
        (wheels / "SOURCE").write_text(stamp + "\n")
    return _run(tmp_path, wheels)


def _source_hash():
    return subprocess.run(["bash", str(SCRIPT.parent / "source_hash.sh")], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_gpu_check_refuses_wheels_of_other_sources(tmp_path):
    """A wheel folder made before the last change would have the GPU test old code: refused
    in one line before any stage runs (unstamped, or stamped with other sources)."""
    for i, stamp in enumerate((None, "0123456789abcdef")):
        out, done = _run_with_wheels(tmp_path / str(i), stamp)
        assert done.returncode == 1
        assert done.stderr.count("\n") == 1 and "bash bench/gpu_wheels.sh" in done.stderr
        assert not (out / "stages.jsonl").exists()


def test_gpu_check_installs_wheels_of_this_checkout(tmp_path):
    out, done = _run_with_wheels(tmp_path, _source_hash())
    assert done.returncode == 0, done.stderr
    assert len((out / "stages.jsonl").read_text().splitlines()) == len(STAGES)


def test_gpu_check_stays_within_its_total_time(tmp_path):
    """With no time left (TOTAL_S=0) no stage runs: each is recorded as timed out, and the
    script still ends with its files in place."""
    out, done = _run(tmp_path, tmp_path / "no-wheels", TOTAL_S="0")
    assert done.returncode == 0, done.stderr
    stages = [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]
    assert [(s["stage"], s["rc"]) for s in stages] == [(name, 124) for name in STAGES]
    assert sorted(p.name for p in out.iterdir()) == ["logs.txt", "stages.jsonl"]
    assert "== profile: not run, no time left" in (out / "logs.txt").read_text()
