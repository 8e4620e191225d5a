"""A QLoRA training step on a GPU: tokens/s and peak GPU memory against the memory plan, as JSON.

Writes a random Hugging Face folder of a model's shape (float16; one layer's random matrices
repeated in every layer, so writing 7B takes seconds, not minutes), then runs
packlora.memory.measure on `device: cuda` (NF4 + double quantization, LoRA on every linear
layer): one warm-up step, then `--steps` measured ones, for each of `--precisions` in turn
(float32; tf32: the run's `tf32: true`, cuBLAS on TF32 tensor cores), each from a fresh load.
The peak is cupy's pool, taken at every allocation from it; the plan is memory-report's.
Prints a JSON list, one object per precision. With --profile it instead runs `--steps` steps
(float32, after a warm-up) under cProfile, the GPU synchronised at the end, and prints where the
host's time went: the functions with the most time of their own and the most in all.

Usage: python bench/gpu_train_step.py --model smollm2|llama7b --out DIR [--layers N] [--steps 2]
       [--precisions float32,tf32] [--device cuda:0] [--profile]
"""
import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import packlora as pl  # noqa: I001  (first: thread settings before numpy loads OpenBLAS)
import numpy as np
from packlora.config import resolve_config
from packlora.memory.measurement import load_adapted, random_examples
from packlora.training.run import run_device
from packlora.training.trainer import Trainer

SHAPES = {  # config.json of each shape (Llama family)
    "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                "tie_word_embeddings": True, "rope_theta": 100000.0},
    "llama7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                "tie_word_embeddings": False, "rope_theta": 10000.0},
}
RUNS = {  # model -> (rank, batch, seq, checkpointing, LoRA dropout): the README's settings
    "smollm2": (16, 4, 256, False, 0.0),           # configs/smollm2-demo.yaml
    "llama7b": (64, 1, 512, True, 0.05),           # configs/llama2-7b-qlora.yaml
}


def _layer_tensors(cfg, rng):
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def mat(n, k):
        return (rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(np.float16)
    return {"self_attn.q_proj": mat(d, d), "self_attn.k_proj": mat(kv, d),
            "self_attn.v_proj": mat(kv, d), "self_attn.o_proj": mat(d, d),
            "mlp.gate_proj": mat(f, d), "mlp.up_proj": mat(f, d), "mlp.down_proj": mat(d, f)}


def write_model(folder, name, layers):
    """config.json + model.safetensors (float16) of a random model of SHAPES[name]."""
    from safetensors.numpy import save_file
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "bos_token_id": 1,
           "eos_token_id": 2, "torch_dtype": "float16", **SHAPES[name]}
    if layers:
        cfg["num_hidden_layers"] = layers
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    one = _layer_tensors(cfg, rng)
    ones = np.ones(d, np.float16)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((v, d), np.float32)
               .astype(np.float16), "model.norm.weight": ones}
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = (rng.standard_normal((v, d), np.float32) / np.sqrt(d)
                                     ).astype(np.float16)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = ones
        tensors[f"{p}.post_attention_layernorm.weight"] = ones
        tensors.update({f"{p}.{k}.weight": w for k, w in one.items()})
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return cfg


def _summary(rep, tokens):
    """Step time, tokens/s and the peaks of one memory.measure report, against its plan."""
    m, plan = rep["measured"], rep["plan"]
    step, proc = m["step_time_s"], m["process_peak_bytes"]
    return {
        "step_time_s": round(step, 4), "tokens_per_s": round(tokens / step, 1),
        "plan_peak_mib": round(plan["peak_bytes"] / 2**20, 1),
        "tracker_peak_mib": round(m["peak_bytes"] / 2**20, 1),
        "process_peak_mib": None if proc is None else round(proc / 2**20, 1),
        "process_measure": m["process_measure"],
        "plan_vs_process_pct": (None if not proc else round(
            100 * (plan["peak_bytes"] - proc) / proc, 2)),
        "plan_error_pct": m["plan_error_pct"],
        "plan_categories_mib": {c: round(v / 2**20, 1) for c, v in plan["categories"].items()},
        "measured_categories_mib": {c: round(v / 2**20, 1) for c, v in m["categories"].items()},
    }


def profile(run, batch, seq, steps, top=40):
    """Host time of `steps` training steps of `run` by function (cProfile), after a warm-up."""
    cfg = resolve_config(run)
    dev = run_device(cfg)
    model = load_adapted(cfg, cfg.model, dev)
    examples = random_examples(batch, seq, model.config.vocab_size, cfg.train.seed)
    tcfg = cfg.train.model_copy(update={"max_steps": steps + 1, "save_every": 0,
                                        "eval_every": 0, "epochs": None})
    with tempfile.TemporaryDirectory(prefix="packlora-profile-") as out:
        trainer = Trainer(model, examples, tcfg, output_dir=out, progress=False)
        trainer.train_step()
        dev.sync()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            trainer.train_step()
        dev.sync()
        prof.disable()
        wall = (time.perf_counter() - t0) / steps
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, own, all, callers)

    def rows(col):
        best = sorted(stats.items(), key=lambda kv: -kv[1][col])[:top]
        return [{"function": f"{Path(f).name}:{line}:{name}", "calls": v[1],
                 "own_ms_per_step": round(1e3 * v[2] / steps, 2),
                 "all_ms_per_step": round(1e3 * v[3] / steps, 2)} for (f, line, name), v in best]
    return {"step_s_profiled": round(wall, 4), "by_own_time": rows(2), "by_all_time": rows(3)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--out", required=True, help="folder for the random model and data")
    p.add_argument("--layers", type=int, default=0, help="layers (default: the model's)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--precisions", default="float32", help="float32 and/or tf32, in that order")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N (or cpu, to try the script)")
    p.add_argument("--profile", action="store_true", help="where a float32 step's host time goes")
    args = p.parse_args(argv)
    precisions = args.precisions.split(",")
    if not set(precisions) <= {"float32", "tf32"}:
        p.error(f"--precisions: float32 and/or tf32, got {args.precisions!r}")
    out = Path(args.out)
    t0 = time.perf_counter()
    cfg = write_model(out / args.model, args.model, args.layers)
    write_s = time.perf_counter() - t0
    (out / "train.jsonl").write_text('{"text": "hello"}\n')
    rank, batch, seq, ckpt, dropout = RUNS[args.model]
    run = {"model": str(out / args.model), "device": args.device,
           "quant": {"format": "nf4", "block_size": 64, "double_quant": True},
           "lora": {"rank": rank, "alpha": 2 * rank, "targets": "all-linear",
                    "dropout": dropout},
           "data": {"train": str(out / "train.jsonl"), "max_seq_len": seq, "format": "text"},
           "train": {"batch_size": batch, "grad_checkpointing": ckpt, "max_steps": 10},
           "output_dir": str(out / "run")}
    if args.profile:
        print(json.dumps({"model": args.model, "layers": cfg["num_hidden_layers"], "batch": batch,
                          "seq": seq, **profile(run, batch, seq, args.steps)}, indent=1))
        return 0
    results = []
    for precision in precisions:
        t0 = time.perf_counter()
        rep = pl.memory.measure({**run, "tf32": precision == "tf32"}, steps=args.steps)
        tf32 = pl.Device.parse(args.device).tf32  # what ran: a GPU without TF32 stays float32
        results.append({"model": args.model, "precision": "tf32" if tf32 else "float32",
                        "layers": cfg["num_hidden_layers"], "rank": rank, "batch": batch,
                        "seq": seq, "grad_checkpointing": ckpt, "dropout": dropout,
                        "write_model_s": round(write_s, 1),
                        "measure_s": round(time.perf_counter() - t0, 1),
                        **_summary(rep, batch * seq)})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
