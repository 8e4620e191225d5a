"""`packlora merge --out model.gguf` of a Llama-2-7B-shaped GGUF: peak RSS of the whole merge
process against the merge plan `packlora memory-report` gives, printed as JSON.

The base is written once into the cache (random Q4_0 blocks with a fixed scale, F32 norms;
3.6 GiB, deterministic) with a random r = 16 adapter on every linear layer. Both commands run
in processes of their own; the peak is the merge process's VmHWM.

    python bench/merge_7b.py [--quantize q8_0] [--out results.json]
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hostinfo import cpu_name  # bench/hostinfo.py

import packlora  # noqa: F401  (before numpy: packlora sets the BLAS/allocator environment)
import numpy as np
from gguf import GGMLQuantizationType as GGML
from gguf import GGUFValueType as V
from packlora.gguf_out.stream import GGUFStream, TensorPlan
from safetensors.numpy import save_file

SHAPE = {"vocab": 32000, "hidden": 4096, "inter": 11008, "layers": 32, "heads": 32}
PROJ = {"attn_q": ("self_attn.q_proj", 0), "attn_k": ("self_attn.k_proj", 0),
        "attn_v": ("self_attn.v_proj", 0), "attn_output": ("self_attn.o_proj", 0),
        "ffn_gate": ("mlp.gate_proj", 1), "ffn_up": ("mlp.up_proj", 1),
        "ffn_down": ("mlp.down_proj", 2)}
RANK, ALPHA = 16, 32


def proj_shape(kind):
    d, f = SHAPE["hidden"], SHAPE["inter"]
    return [(d, d), (f, d), (d, f)][kind]


def tensors():
    """[(ggml name, shape, type)] of the base, in llama.cpp's order."""
    d, v = SHAPE["hidden"], SHAPE["vocab"]
    out = [("token_embd.weight", (v, d), GGML.Q4_0)]
    for i in range(SHAPE["layers"]):
        out.append((f"blk.{i}.attn_norm.weight", (d,), GGML.F32))
        out += [(f"blk.{i}.{n}.weight", proj_shape(k), GGML.Q4_0) for n, (_, k) in PROJ.items()]
        out.append((f"blk.{i}.ffn_norm.weight", (d,), GGML.F32))
    return out + [("output_norm.weight", (d,), GGML.F32), ("output.weight", (v, d), GGML.Q4_0)]


def write_base(path):
    s = SHAPE
    kv = [(f"llama.{k}", val, V.UINT32, None) for k, val in (
        ("context_length", 4096), ("embedding_length", s["hidden"]),
        ("block_count", s["layers"]), ("feed_forward_length", s["inter"]),
        ("attention.head_count", s["heads"]), ("attention.head_count_kv", s["heads"]),
        ("rope.dimension_count", s["hidden"] // s["heads"]), ("vocab_size", s["vocab"]))]
    kv += [("llama.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32, None),
           ("general.name", "random llama-2-7b shape", V.STRING, None)]
    plans = [TensorPlan(n, shape, t) for n, shape, t in tensors()]
    rng = np.random.default_rng(0)
    scale = np.array([0.02], np.float16).view(np.uint8)
    with GGUFStream(path, "llama", kv, plans) as f:
        for p in plans:
            if p.type == GGML.F32:
                f.write(p.name, np.ones(p.shape, np.float32))
                continue
            for r0 in range(0, p.shape[0], 1024):
                rows = min(1024, p.shape[0] - r0)
                blocks = rng.integers(0, 256, (rows, p.shape[1] // 32, 18), dtype=np.uint8)
                blocks[..., :2] = scale
                f.write(p.name, blocks)


def write_adapter(folder):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    w = {}
    for i in range(SHAPE["layers"]):
        for hf, k in PROJ.values():
            n_out, n_in = proj_shape(k)
            pre = f"base_model.model.model.layers.{i}.{hf}"
            w[f"{pre}.lora_A.weight"] = (0.01 * rng.standard_normal((RANK, n_in))).astype(
                np.float32)
            w[f"{pre}.lora_B.weight"] = (0.01 * rng.standard_normal((n_out, RANK))).astype(
                np.float32)
    save_file(w, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = sorted({hf.split(".")[-1] for hf, _ in PROJ.values()})
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA,
         "target_modules": targets}))


def packlora_cli(*args, peak=False):
    code = "import sys; from packlora.cli import main; rc = main(sys.argv[1:]); "
    code += "from packlora.tracker import rss_peak; print(rss_peak()); " if peak else ""
    code += "sys.exit(rc)"
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"packlora {' '.join(args)} failed: {run.stderr.strip()}")
    return run.stdout, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize", default=None, help="merge --quantize (default: keep Q4_0)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cache = Path(os.environ.get("PACKLORA_CACHE", Path.home() / ".cache" / "packlora"))
    work = cache / "bench-merge-7b"
    base, adapter, merged = work / "base-q4_0.gguf", work / "adapter", work / "merged.gguf"
    if not base.is_file():
        write_base(base)
    if not (adapter / "adapter_config.json").is_file():
        write_adapter(adapter)
    cfg = work / "plan.yaml"
    cfg.write_text(f"model: {base}\nlora: {{rank: {RANK}, alpha: {ALPHA}, targets: all-linear}}"
                   "\ndata: {train: none}\n")
    plan = json.loads(packlora_cli("memory-report", str(cfg), "--json")[0])["plan"]["merge"]
    merged.unlink(missing_ok=True)
    args = ["merge", "--model", str(base), "--adapter", str(adapter), "--out", str(merged)]
    out, wall = packlora_cli(*args, *(["--quantize", a.quantize] if a.quantize else []),
                             peak=True)
    peak = int(out.split()[-1])
    result = {"cpu": cpu_name(), "cores": os.cpu_count(), "base_bytes": base.stat().st_size,
              "merged_bytes": merged.stat().st_size, "quantize": a.quantize or "as stored",
              "plan_mib": {k: round(v / 2**20, 1) for k, v in plan.items()},
              "measured_peak_rss_mib": round(peak / 2**20, 1),
              "measured_over_plan": round(peak / plan["peak_bytes"], 3),
              "within_plan": peak <= plan["peak_bytes"], "merge_wall_s": round(wall, 1)}
    merged.unlink()
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
