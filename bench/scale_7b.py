"""A Llama-2-7B-shaped QLoRA on this CPU: the whole process's peak RSS against the plan.

Writes a Hugging Face folder of random float16 weights once (deterministic, ~13 GB, streamed to
disk a piece at a time) into the cache, then runs `packlora memory-report CFG --measure
--steps 1 --json` in a process of its own (NF4 + double quantization, r = 64 on every linear
layer, batch 1 x 512, checkpointing) and prints JSON: that process's peak RSS over its whole
life (the report resets VmHWM before its measured step, so the peaks it read while loading and
warming up count too, and each is printed: loading must stay under training), the plan, the
RAM the report says the run needs (the plan plus the process's own bytes), the tracker's peak,
per-category errors and the step time.

    python bench/scale_7b.py [--optimizer adamw_8bit] [--embeddings auto] [--step-in-backward]
                             [--out results.json]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import packlora  # noqa: F401, I001  (first: thread settings before numpy loads OpenBLAS)
import numpy as np
from packlora.models import ModelConfig, model_tensors

from hostinfo import cpu_name  # bench/hostinfo.py

HERE = Path(__file__).resolve().parent
CONFIG = json.loads((HERE.parent / "configs/models/llama-2-7b/config.json").read_text())
CACHE = Path(os.environ.get("PACKLORA_CACHE", Path.home() / ".cache/packlora")) / "bench-scale-7b"
CHUNK = 1 << 24  # values generated and written at a time


def tensors():
    """[(HF name, shape)] of the model, in the loader's order (models.tensors, the one list)."""
    return [(t.name, t.shape) for t in model_tensors(ModelConfig.from_hf(CONFIG), "none")]


def write_folder(folder):
    """model.safetensors (F16) and config.json; the header first, then each tensor's bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    header, at = {}, 0
    for name, shape in tensors():
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = folder / "model.safetensors.tmp"
    rng = np.random.default_rng(0)
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in tensors():
            total = int(np.prod(shape))
            if len(shape) == 1:
                f.write(np.ones(total, "<f2").tobytes())
                continue
            for i in range(0, total, CHUNK):
                vals = rng.standard_normal(min(CHUNK, total - i), dtype=np.float32) * 0.02
                f.write(vals.astype("<f2").tobytes())
    tmp.rename(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=1))


def run_config(folder, a):
    return {"model": str(folder), "device": "cpu",
            "quant": {"format": "nf4", "block_size": 64, "double_quant": True,
                      "embeddings": a.embeddings},
            "lora": {"rank": 64, "alpha": 16, "dropout": 0.0, "targets": "all-linear"},
            "data": {"train": str(CACHE / "unused.jsonl"), "format": "text",
                     "max_seq_len": 512},  # the measured steps train on random tokens
            "train": {"batch_size": 1, "grad_checkpointing": True, "optimizer": a.optimizer,
                      **({"step_in_backward": True, "max_grad_norm": None}
                         if a.step_in_backward else {})}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--optimizer", default="adamw_8bit")
    ap.add_argument("--embeddings", default="auto")
    ap.add_argument("--step-in-backward", action="store_true",
                    help="train.step_in_backward (each gradient applied and freed in backward)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    folder = CACHE / "hf"
    if not (folder / "model.safetensors").is_file():
        print(f"scale_7b: writing {folder} (~13 GB, once)", file=sys.stderr)
        write_folder(folder)
    (CACHE / "unused.jsonl").write_text('{"text": "not read by memory-report"}\n')
    cfg = CACHE / f"run-{a.optimizer}-{a.embeddings}-{int(a.step_in_backward)}.yaml"  # JSON = YAML
    cfg.write_text(json.dumps(run_config(folder, a)))
    cmd = [sys.executable, "-m", "packlora.cli", "memory-report", str(cfg), "--measure",
           "--steps", "1", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"scale_7b: memory-report failed:\n{proc.stderr[-3000:]}")
    rep = json.loads(proc.stdout[proc.stdout.index("{"):])
    plan, meas = rep["plan"], rep["measured"]
    after_reset = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    vmhwm = max(after_reset, meas["rss_load_peak_bytes"], meas["rss_warmup_peak_bytes"],
                meas["rss_peak_bytes"] or 0)
    mib = (lambda b: None if b is None else round(b / 2**20, 1))
    doc = {"bench": "scale_7b", "cpu": cpu_name(), "cores": os.cpu_count(),
           "run": run_config(folder, a) | {"model": "random Llama-2-7B shape, float16"},
           "process_peak_rss_mib": mib(vmhwm),
           "load_peak_rss_mib": mib(meas["rss_load_peak_bytes"]),
           "warmup_peak_rss_mib": mib(meas["rss_warmup_peak_bytes"]),
           "step_peak_rss_mib": mib(meas["rss_peak_bytes"]),
           "plan_peak_mib": mib(plan["peak_bytes"]),
           "plan_vs_rss_pct": round(100.0 * (plan["peak_bytes"] - vmhwm) / vmhwm, 1),
           "process_mib": mib(rep["process"]["bytes"]),
           "ram_needed_mib": mib(rep["process"]["rss_estimate_bytes"]),
           "ram_needed_vs_rss_pct": round(100.0 * (rep["process"]["rss_estimate_bytes"] - vmhwm)
                                          / vmhwm, 1),
           "tracker_peak_mib": mib(meas["peak_bytes"]),
           "plan_vs_tracker_pct": meas["plan_error_pct"],
           "plan_categories_mib": {k: mib(v) for k, v in plan["categories"].items() if v},
           "category_error_pct": meas["category_error_pct"],
           "step_time_s": round(meas["step_time_s"], 1),
           "target": {"process_peak_rss_mib": 5120, "ram_needed_vs_rss_pct": 5}}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
